"""Pipeline parallelism: schedules as data, a unit-cost simulator, and an executor on MPI."""

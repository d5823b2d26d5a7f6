"""Pipeline parallelism: schedules as data, a simulator (unit or measured costs), and an executor on MPI."""

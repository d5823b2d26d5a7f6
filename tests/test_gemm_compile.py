"""gemm.cu through the two compilers it meets: nvcc here (every kernel the launcher uses, for the
GPUs we target, without register spills or local memory), and NVRTC, which cupy.RawModule runs on
the GPU machine. Results: test_gemm_kernel.py (the CPU emulator) and test_gpu.py."""

import re
import shutil

import pytest

from mpi_run import run_together

from minipar.kernels import gemm


# ---- nvcc -------------------------------------------------------------------------------------
def instantiations():
    """gemm.cu plus an explicit instantiation of every kernel the launcher uses."""
    lines = [gemm.SOURCE.read_text()]
    for dtype, ctype in gemm.CTYPES.items():
        for naive in (False, True):
            for ta in (False, True):
                for tb in (False, True):
                    name = gemm.kernel_name(dtype, ta, tb, naive)
                    lines.append(f"template __global__ void {name}(const {ctype}*, const {ctype}*, {ctype}*, "
                                 "int, int, int, int, int, int, long long, long long, long long);")
    return "\n".join(lines)


ARCHS = ("sm_80", "sm_90")


@pytest.fixture(scope="module")
def nvcc_reports(tmp_path_factory):
    """{arch: its nvcc run} for every kernel compiled for each arch, side by side (~9 s each)."""
    folder = tmp_path_factory.mktemp("nvcc")
    source = folder / "gemm_all.cu"
    source.write_text(instantiations())
    return run_together({arch: ["nvcc", "-cubin", f"-arch={arch}", "-std=c++17", "-Xptxas", "-v",
                                "-o", str(folder / f"gemm_{arch}.cubin"), str(source)] for arch in ARCHS})


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", ARCHS)
def test_nvcc_compiles_every_kernel_without_spills(arch, nvcc_reports):
    result = nvcc_reports[arch]
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    kernels = re.findall(r"Compiling entry function '(\w+)'", report)
    assert len(kernels) == 32, report  # 4 dtypes x (tiled, naive) x 4 transpose cases
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    stacks = re.findall(r"(\d+) bytes stack frame", report)
    assert len(spills) == 32 and all(s == ("0", "0") for s in spills), report
    assert all(s == "0" for s in stacks), report  # no local memory
    registers = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
    assert len(registers) == 32 and max(registers) <= 255, report


# ---- NVRTC: the compiler cupy.RawModule runs on the GPU machine ---------------------------------
def nvrtc_candidates():
    """Where libnvrtc may be: the system's library path, the CUDA 12 wheel
    (``nvidia/cuda_nvrtc/lib``) and the CUDA 13 wheels (``nvidia/cu13/lib``), in that order."""
    import ctypes.util
    import glob
    import importlib.util

    paths = [ctypes.util.find_library("nvrtc")]
    try:
        nvidia = importlib.util.find_spec("nvidia")  # a namespace package: one folder per wheel's site
    except (ModuleNotFoundError, ValueError):
        nvidia = None
    for folder in (nvidia.submodule_search_locations if nvidia else []):
        for layout in ("cuda_nvrtc/lib", "cu*/lib"):
            paths += sorted(glob.glob(f"{folder}/{layout}/libnvrtc.so*"))
    return [p for p in paths if p and "builtins" not in p]


def nvrtc():
    """libnvrtc loaded, or None."""
    import ctypes

    for path in nvrtc_candidates():
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def test_nvrtc_is_found_in_the_cuda_12_and_the_cuda_13_wheel_layouts(tmp_path, monkeypatch):
    import importlib
    import sys

    for layout in ("cuda_nvrtc/lib/libnvrtc.so.12", "cu13/lib/libnvrtc.so.13", "cu13/lib/libnvrtc-builtins.so.13"):
        (tmp_path / "nvidia" / layout).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "nvidia" / layout).touch()
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + [p for p in sys.path if p])
    monkeypatch.delitem(sys.modules, "nvidia", raising=False)
    importlib.invalidate_caches()
    found = nvrtc_candidates()
    assert str(tmp_path / "nvidia/cuda_nvrtc/lib/libnvrtc.so.12") in found
    assert str(tmp_path / "nvidia/cu13/lib/libnvrtc.so.13") in found
    assert not any("builtins" in p for p in found)


@pytest.mark.skipif(nvrtc() is None, reason="no NVRTC (CUDA toolkit, or pip install nvidia-cuda-nvrtc-cu12 / nvidia-cuda-nvrtc for CUDA 13)")
@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_nvrtc_compiles_the_source_and_finds_every_kernel_the_launcher_asks_for(arch):
    import ctypes

    lib = nvrtc()
    program = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(program), gemm.SOURCE.read_bytes(), b"gemm.cu", 0, None, None) == 0
    names = [gemm.kernel_name(dtype, ta, tb, naive).encode() for dtype in gemm.TILES for naive in (False, True)
             for ta in (False, True) for tb in (False, True)]
    for name in names:
        assert lib.nvrtcAddNameExpression(program, name) == 0
    options = (ctypes.c_char_p * 2)(b"-std=c++17", f"-arch={arch}".encode())  # as gemm._module passes
    result = lib.nvrtcCompileProgram(program, 2, options)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(program, log)
    assert result == 0, log.value.decode()
    for name in names:
        lowered = ctypes.c_char_p()
        assert lib.nvrtcGetLoweredName(program, name, ctypes.byref(lowered)) == 0 and lowered.value, name
    lib.nvrtcDestroyProgram(ctypes.byref(program))

"""In-tree PEP 517 build backend: setuptools, plus CUDA discovery.

It exists for one reason: when nvcc is present but the CUDA toolkit has no cuBLAS (nvcc from a
distribution package, or a runtime-only toolkit), the build needs cuBLAS headers and libraries
from the `nvidia-cublas` wheel. PEP 517's get_requires_for_build_* hooks let us ask pip for
that wheel only in that case, so CPU-only machines never download it.

setup.py imports the discovery helpers below, so there is one definition of "where is CUDA".
"""
import os
import re
import shutil
import subprocess
import sys

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (re-export the standard hooks)


def cuda_settings():
    """(mode, emulator) from FASTTRAN_CUDA, a comma-separated list:
    mode 'off', 'on' (nvcc build required) or 'auto' (the default: build with nvcc only when nvcc
    AND a GPU are present, so a CPU machine with a CUDA toolkit downloads no cuBLAS); 'emu' also
    builds the emulated CUDA backend (test infrastructure, csrc/cuda_emu)."""
    words = [w.strip().lower() for w in os.environ.get("FASTTRAN_CUDA", "").split(",") if w.strip()]
    mode, emu = "auto", False
    for w in words:
        if w in ("0", "off", "false", "no"):
            mode = "off"
        elif w in ("1", "on", "true", "yes"):
            mode = "on"
        elif w == "auto":
            mode = "auto"
        elif w == "emu":
            emu = True
        else:
            raise RuntimeError(f"FASTTRAN_CUDA must be a comma-separated list of 0, 1, auto and emu, got {w!r}")
    if emu and "auto" not in words and "on" not in words and "1" not in words:
        mode = "off"   # FASTTRAN_CUDA=emu alone: the emulator, no nvcc build
    return mode, emu


def cuda_mode():
    return cuda_settings()[0]


def gpu_present():
    """An NVIDIA GPU is visible to this machine (driver loaded)."""
    import glob as _glob
    return bool(_glob.glob("/dev/nvidia[0-9]*") or _glob.glob("/proc/driver/nvidia/gpus/*"))


def want_nvcc_build():
    """(build?, reason): the nvcc build of the CUDA backend happens when asked (FASTTRAN_CUDA=1),
    or in auto mode when nvcc and a GPU are both present."""
    mode, emu = cuda_settings()
    if mode == "off":
        return False, "FASTTRAN_CUDA=emu: the CUDA emulator only" if emu else "FASTTRAN_CUDA=0"
    nvcc = find_nvcc()
    if mode == "on":
        return True, "FASTTRAN_CUDA=1"
    if not nvcc:
        return False, "no nvcc found"
    if not gpu_present():
        return False, "nvcc found but no GPU on this machine (FASTTRAN_CUDA=1 builds it anyway)"
    return True, "nvcc and a GPU found"


def find_nvcc():
    """Path of nvcc: $CUDA_HOME/bin, $CUDA_PATH/bin, PATH, /usr/local/cuda/bin, or the
    nvidia-cuda-nvcc wheel. None when absent."""
    for env in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(env)
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return os.path.realpath(found)
    if os.path.isfile("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda/bin/nvcc"
    d = _wheel_dir("cuda_nvcc")
    if d and os.path.isfile(os.path.join(d, "bin", "nvcc")):
        return os.path.join(d, "bin", "nvcc")
    return None


def nvcc_version(nvcc):
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _wheel_dir(name):
    """Directory of an nvidia-* wheel component (nvidia/<name>) on sys.path, or None."""
    for p in sys.path:
        d = os.path.join(p, "nvidia", name)
        if os.path.isdir(d):
            return d
    # CUDA 13 wheels install under nvidia/cu13/
    for p in sys.path:
        d = os.path.join(p, "nvidia", "cu13")
        if os.path.isdir(os.path.join(d, "include")) and os.path.isfile(
            os.path.join(d, "include", "cublas_v2.h" if name == "cublas" else "cuda_runtime.h")
        ):
            return d
    return None


def find_cublas(cuda_home):
    """(include_dir, lib_dir, source) of cuBLAS: the toolkit, else the nvidia-cublas wheel."""
    inc = os.path.join(cuda_home, "include")
    for lib in ("lib64", os.path.join("targets", "x86_64-linux", "lib"), "lib"):
        libdir = os.path.join(cuda_home, lib)
        if os.path.isfile(os.path.join(inc, "cublas_v2.h")) and os.path.exists(
            os.path.join(libdir, "libcublas.so")
        ):
            return inc, libdir, "toolkit"
    d = _wheel_dir("cublas")
    if d:
        libdir = os.path.join(d, "lib")
        return os.path.join(d, "include"), libdir, "nvidia-cublas wheel"
    return None


def _site_dirs():
    """Where installed wheels may be: sys.path, and the installing environment's site-packages
    (pip's isolated build environment leaves them off sys.path)."""
    import site
    import sysconfig
    dirs = list(sys.path)
    try:
        dirs += site.getsitepackages()
    except AttributeError:   # pragma: no cover - old virtualenv's site module
        pass
    venv = os.environ.get("VIRTUAL_ENV")
    if venv:
        dirs.append(os.path.join(venv, "lib", "python%d.%d" % sys.version_info[:2], "site-packages"))
    dirs.append(sysconfig.get_paths()["purelib"])
    seen, out = set(), []
    for d in dirs:
        if d and os.path.isdir(d) and d not in seen:
            seen.add(d)
            out.append(d)
    return out


CUDNN_WHEELS = ["nvidia-cudnn-frontend", "nvidia-cudnn-cu13", "nvidia-cuda-nvrtc"]


def cudnn_requested():
    """FASTTRAN_CUDNN=1: the nvcc build also builds cuDNN attention, its wheels (CUDNN_WHEELS) asked
    of pip as build and run requirements; unset: built when they are already installed; 0: never."""
    return os.environ.get("FASTTRAN_CUDNN", "").strip().lower() in ("1", "on", "yes", "true")


def find_cudnn(cuda_home):
    """(paths, reason) for cuDNN attention (csrc/cuda/cudnn_att.cpp -> libfasttran_cudnn.so), built
    beside the nvcc build only where its headers and libraries are installed (never downloaded by
    the build: `pip install nvidia-cudnn-frontend nvidia-cudnn-cu13 nvidia-cuda-nvrtc` first).
    paths: include dirs (cudnn-frontend, cuDNN, nvrtc) and the lib dirs of libcudnn.so.9 and
    libnvrtc; None with the reason when something is missing or FASTTRAN_CUDNN=0."""
    if os.environ.get("FASTTRAN_CUDNN", "").strip().lower() in ("0", "off", "no", "false"):
        return None, "FASTTRAN_CUDNN=0"

    def first(candidates, name):
        for d in candidates:
            if d and os.path.isfile(os.path.join(d, name)):
                return d
        return None

    site = _site_dirs()
    # FASTTRAN_CUDNN_FRONTEND_INCLUDE: a folder of cudnn-frontend headers (the wheel's include/)
    frontend = first([os.environ.get("FASTTRAN_CUDNN_FRONTEND_INCLUDE")] + [os.path.join(p, "include") for p in site],
                     "cudnn_frontend.h")
    cudnn_inc = first([os.path.join(p, "nvidia", "cudnn", "include") for p in site] +
                      [os.path.join(cuda_home, "include"), "/usr/include"], "cudnn.h")
    nvrtc_inc = first([os.path.join(p, "nvidia", "cu13", "include") for p in site] +
                      [os.path.join(p, "nvidia", "cuda_nvrtc", "include") for p in site] +
                      [os.path.join(cuda_home, "include")], "nvrtc.h")
    missing = [name for name, d in (("cudnn_frontend.h (pip install nvidia-cudnn-frontend)", frontend),
                                    ("cudnn.h (pip install nvidia-cudnn-cu13)", cudnn_inc),
                                    ("nvrtc.h (pip install nvidia-cuda-nvrtc)", nvrtc_inc)) if not d]
    if missing:
        return None, "not found: " + ", ".join(missing)
    import glob as _glob

    def lib_dir(include_dir, stem):
        for d in (os.path.join(os.path.dirname(include_dir), "lib"), os.path.join(os.path.dirname(include_dir), "lib64"),
                  os.path.join(cuda_home, "lib64"), "/usr/lib/x86_64-linux-gnu"):
            if _glob.glob(os.path.join(d, stem + ".so*")):
                return d
        return None

    cudnn_lib, nvrtc_lib = lib_dir(cudnn_inc, "libcudnn"), lib_dir(nvrtc_inc, "libnvrtc")
    if not cudnn_lib or not nvrtc_lib:
        return None, "headers found but not " + ("libcudnn.so.9" if not cudnn_lib else "libnvrtc.so")
    return {"includes": [frontend, cudnn_inc, nvrtc_inc], "cudnn_lib": cudnn_lib, "nvrtc_lib": nvrtc_lib}, "built"


def cublas_wheel_name(nvcc):
    major = nvcc_version(nvcc)[0]
    return "nvidia-cublas" if major >= 13 else f"nvidia-cublas-cu{major}"


def _extra_requires():
    if not want_nvcc_build()[0]:
        return []
    if cudnn_requested():
        return _cublas_requires() + CUDNN_WHEELS
    return _cublas_requires()


def _cublas_requires():
    nvcc = find_nvcc()
    if not nvcc:
        return []
    home = os.path.dirname(os.path.dirname(nvcc))
    if find_cublas(home):
        return []
    return [cublas_wheel_name(nvcc)]


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _extra_requires()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _extra_requires()

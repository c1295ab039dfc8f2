"""Build fasttran: the C extension fasttran._C (core, CPU backend, binding) and, when CUDA is
found, the CUDA backend library fasttran/libfasttran_cuda.so (opened at run time by the core).

Environment:
  FASTTRAN_CUDA=0|1|auto   the nvcc-built CUDA backend: off / on (on without nvcc is an error) /
                           auto (default: only when nvcc and a GPU are both present)
  FASTTRAN_CUDA=emu        also (",emu") or only ("emu") the emulated CUDA backend
                           fasttran/libfasttran_cuda_emu.so: the same .cu sources built with the
                           host C++ compiler against csrc/cuda_emu, for tests on machines without a
                           GPU (loaded only when FASTTRAN_CUDA_EMU=1; never a user-facing device)
  FASTTRAN_CUDA_ARCHS      e.g. "80;90" (SASS for each, plus PTX for the lowest)
  FASTTRAN_CUDNN=1|0       cuDNN attention (fasttran/libfasttran_cudnn.so, csrc/cuda/cudnn_att.cpp)
                           beside the nvcc build: 1 asks pip for its wheels (nvidia-cudnn-frontend,
                           nvidia-cudnn-cu13, nvidia-cuda-nvrtc); unset builds it when they are
                           already installed in the installing environment; 0 never
  FASTTRAN_MARCH           -march for the CPU code (default: native; "" to omit)
  FASTTRAN_SANITIZE=address  build with AddressSanitizer (tests run with LD_PRELOAD=libasan)
  FASTTRAN_DEBUG=1         -O0 -g
"""
import glob
import os
import platform
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import build_backend as cuda_env  # noqa: E402  (one definition of CUDA discovery)

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("csrc")
BASE_DEPS = ["numpy>=2.0", "scipy-openblas32>=0.3.27", "tqdm"]


def c_sources():
    dirs = ["core", "io", "cpu", "model", "cache", "train", "dist", "python"]
    return sorted(f for d in dirs for f in glob.glob(os.path.join(CSRC, d, "*.c")))


def cpu_flags():
    flags = ["-std=c11", "-fopenmp", "-fvisibility=hidden", "-D_DEFAULT_SOURCE", "-Wall", "-Wextra",
             "-Wno-unused-parameter", "-Wno-missing-field-initializers", "-Wno-cast-function-type"]
    if os.environ.get("FASTTRAN_DEBUG") == "1":
        flags += ["-O0", "-g"]
    else:
        flags += ["-O3", "-fno-math-errno"]
    march = os.environ.get("FASTTRAN_MARCH", "native")
    if march:
        flags.append(f"-march={march}")
        if platform.machine().lower() in ("x86_64", "amd64"):
            # let GCC auto-vectorise the row ops (GELU, LayerNorm) with 512-bit vectors where
            # -march allows them; GCC's tuning for recent Intel cores stops at 256 (measured
            # ~4% of a MiniLM forward on Sapphire Rapids); no effect on AVX2-only targets
            flags.append("-mprefer-vector-width=512")
    if os.environ.get("FASTTRAN_SANITIZE") == "address":
        flags += ["-fsanitize=address", "-fno-omit-frame-pointer", "-g"]
    return flags


def cuda_config():
    """None (no nvcc build) or a dict describing the CUDA toolchain to use."""
    build, reason = cuda_env.want_nvcc_build()
    if not build:
        print("fasttran: CUDA backend not built: " + reason, file=sys.stderr)
        return None
    mode = cuda_env.cuda_mode()
    nvcc = cuda_env.find_nvcc()
    if not nvcc:
        raise RuntimeError("FASTTRAN_CUDA=1 but nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
    home = os.path.dirname(os.path.dirname(nvcc))
    blas = cuda_env.find_cublas(home)
    if not blas:
        msg = ("nvcc found at %s but no cuBLAS (cublas_v2.h) in the toolkit or in an nvidia-cublas wheel; "
               "install %s or set FASTTRAN_CUDA=0" % (nvcc, cuda_env.cublas_wheel_name(nvcc)))
        if mode == "on":
            raise RuntimeError(msg)
        print("fasttran: " + msg + " -- building CPU-only", file=sys.stderr)
        return None
    archs = os.environ.get("FASTTRAN_CUDA_ARCHS", "80;90")
    archs = [a.strip() for a in archs.replace(",", ";").split(";") if a.strip()]
    cudnn, cudnn_reason = cuda_env.find_cudnn(home)
    if not cudnn:
        print("fasttran: cuDNN attention not built: " + cudnn_reason, file=sys.stderr)
    return {"nvcc": nvcc, "home": home, "version": "%d.%d" % cuda_env.nvcc_version(nvcc),
            "cublas_include": blas[0], "cublas_lib": blas[1], "cublas_source": blas[2], "archs": archs,
            "reason": reason, "cudnn": cudnn, "cudnn_reason": cudnn_reason}


def link_flag(libdir, name):
    """-l flag for lib<name>.so, or for its versioned file (the wheels ship only .so.N)."""
    if os.path.exists(os.path.join(libdir, f"lib{name}.so")):
        return f"-l{name}"
    found = sorted(glob.glob(os.path.join(libdir, f"lib{name}.so.*")))
    if not found:
        raise RuntimeError(f"lib{name}.so not found in {libdir}")
    return "-l:" + os.path.basename(found[0])


class FastTranBuildExt(build_ext):
    def build_extensions(self):
        self.cuda = cuda_config()
        self.emu = cuda_env.cuda_settings()[1]
        super().build_extensions()
        out_dir = os.path.join(self.build_lib, "fasttran")
        os.makedirs(out_dir, exist_ok=True)
        for name, wanted in (("libfasttran_cuda.so", self.cuda), ("libfasttran_cuda_emu.so", self.emu),
                             ("libfasttran_cudnn.so", self.cuda and self.cuda["cudnn"])):
            if not wanted and os.path.exists(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))   # a stale library from an earlier build
        if self.cuda:
            self.build_cuda_library(out_dir)
        if self.emu:
            self.build_emulated_cuda_library(out_dir)
        self.write_build_config(out_dir)

    def extra_outputs(self):
        """Files we build beside the extension: the CUDA libraries and the build record."""
        cu = getattr(self, "cuda", None)
        names = ["_build_config.py"] + (["libfasttran_cuda.so"] if cu else []) + \
            (["libfasttran_cudnn.so"] if cu and cu["cudnn"] else []) + \
            (["libfasttran_cuda_emu.so"] if getattr(self, "emu", False) else [])
        return [os.path.join(self.build_lib, "fasttran", n) for n in names]

    def get_outputs(self):
        return super().get_outputs() + self.extra_outputs()

    def copy_extensions_to_source(self):
        # in-place / editable builds: setuptools copies the extension back; our files too
        super().copy_extensions_to_source()
        src_dir = self.get_finalized_command("build_py").get_package_dir("fasttran")
        for name in ("libfasttran_cuda.so", "libfasttran_cuda_emu.so", "libfasttran_cudnn.so"):
            stale = os.path.join(src_dir, name)
            if os.path.exists(stale) and not any(p.endswith(name) for p in self.extra_outputs()):
                os.remove(stale)
        for path in self.extra_outputs():
            self.copy_file(path, os.path.join(src_dir, os.path.basename(path)), level=self.verbose)

    def build_emulated_cuda_library(self, out_dir):
        """The CUDA backend's .cu sources, unmodified, compiled as C++ with the host compiler against
        the CUDA emulator (csrc/cuda_emu) and linked with OpenBLAS (its cuBLAS shim)."""
        import concurrent.futures
        import scipy_openblas32 as ob
        cxx = os.environ.get("CXX", "g++")
        tmp = os.path.join(self.build_temp, "cuda_emu")
        os.makedirs(tmp, exist_ok=True)
        flags = ["-std=c++17", "-fPIC", "-fvisibility=hidden", "-DFT_CUDA_EMU=1", "-Wall", "-Wno-unused-function",
                 "-Wno-unused-variable", "-Wno-unused-parameter",
                 "-I" + os.path.join(CSRC, "cuda_emu"), "-I" + CSRC, "-I" + os.path.join(CSRC, "include"),
                 "-I" + ob.get_include_dir()]
        flags += ["-O0", "-g"] if os.environ.get("FASTTRAN_DEBUG") == "1" else ["-O2", "-g"]
        if os.environ.get("FASTTRAN_SANITIZE") == "address":
            flags += ["-fsanitize=address", "-fno-omit-frame-pointer"]
        sources = sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cu"))) + \
            sorted(glob.glob(os.path.join(CSRC, "cuda_emu", "*.cpp"))) + \
            sorted(glob.glob(os.path.join(CSRC, "cuda_emu", "*.cu")))   # the emulator's self-test kernels

        def compile_one(src):
            obj = os.path.join(tmp, os.path.basename(src) + ".o")
            cmd = [cxx, "-x", "c++", "-c", src, "-o", obj, *flags]
            print(" ".join(cmd))
            subprocess.run(cmd, check=True)
            return obj

        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            objs = list(pool.map(compile_one, sources))
        target = os.path.join(out_dir, "libfasttran_cuda_emu.so")
        libdir = ob.get_lib_dir()
        cmd = [cxx, "-shared", "-o", target, *objs, f"-L{libdir}", f"-l{ob.get_library()}",
               "-Wl,-rpath,$ORIGIN/../scipy_openblas32/lib", f"-Wl,-rpath,{libdir}", "-lpthread"]
        if os.environ.get("FASTTRAN_SANITIZE") == "address":
            cmd.append("-fsanitize=address")
        print(" ".join(cmd))
        subprocess.run(cmd, check=True)

    def build_cuda_library(self, out_dir):
        cu = self.cuda
        objs = []
        tmp = os.path.join(self.build_temp, "cuda")
        os.makedirs(tmp, exist_ok=True)
        gencode = []
        for a in cu["archs"]:
            gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        lowest = min(cu["archs"], key=lambda a: int("".join(c for c in a if c.isdigit())))
        gencode += ["-gencode", f"arch=compute_{lowest},code=compute_{lowest}"]   # PTX for newer GPUs
        sources = sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cu")))

        def compile_one(src):
            obj = os.path.join(tmp, os.path.basename(src) + ".o")
            cmd = [cu["nvcc"], "-c", src, "-o", obj, "-std=c++17", "-O3", "-Xcompiler", "-fPIC,-fvisibility=hidden",
                   "-I" + os.path.join(CSRC), "-I" + os.path.join(CSRC, "include"), "-I" + cu["cublas_include"],
                   *gencode]
            print(" ".join(cmd))
            subprocess.run(cmd, check=True)
            return obj

        def compile_cudnn():
            # cuDNN attention: host C++17 over cudnn-frontend, compiled by nvcc (its host compiler)
            # into its own library, which libfasttran_cuda.so opens at run time (attention_cudnn.cu)
            src = os.path.join(CSRC, "cuda", "cudnn_att.cpp")
            obj = os.path.join(tmp, "cudnn_att.cpp.o")
            cmd = [cu["nvcc"], "-c", src, "-o", obj, "-std=c++17", "-O2", "-Xcompiler",
                   "-fPIC,-fvisibility=hidden,-Wno-unused-function", "-I" + os.path.join(CSRC, "cuda"),
                   *["-I" + d for d in cu["cudnn"]["includes"]], "-I" + cu["cublas_include"]]
            print(" ".join(cmd))
            subprocess.run(cmd, check=True)
            return obj

        import concurrent.futures   # one nvcc per source at once: the sources are independent
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            cudnn_obj = pool.submit(compile_cudnn) if cu["cudnn"] else None   # the longest: first
            objs = list(pool.map(compile_one, sources))
            cudnn_obj = cudnn_obj.result() if cudnn_obj else None
        target = os.path.join(out_dir, "libfasttran_cuda.so")
        cudart_static = os.path.join(cu["home"], "lib64", "libcudart_static.a")
        if not os.path.exists(cudart_static):
            cudart_static = glob.glob(os.path.join(cu["home"], "**", "libcudart_static.a"), recursive=True)[0]
        # cudart is linked statically (no runtime dependency on the toolkit); cuBLAS is found
        # next to the wheel install ($ORIGIN/../nvidia/cu13/lib) or in the toolkit.
        rpaths = ["$ORIGIN/../nvidia/cu13/lib", "$ORIGIN/../nvidia/cublas/lib"]
        if cu["cublas_source"] == "toolkit":
            rpaths.append(cu["cublas_lib"])
        cmd = [cu["nvcc"], "-shared", "-o", target, *objs, cudart_static, "-L" + cu["cublas_lib"],
               link_flag(cu["cublas_lib"], "cublas"), link_flag(cu["cublas_lib"], "cublasLt"),
               "-ldl", "-lpthread", "-lrt", "-Xlinker", "-rpath=" + ":".join(rpaths)]
        print(" ".join(cmd))
        subprocess.run(cmd, check=True)
        if cudnn_obj:
            # libcudnn.so.9 and libnvrtc from their wheels ($ORIGIN/../nvidia/...) or where the build
            # found them; cudart static, as above
            dn = cu["cudnn"]
            rpaths = ["$ORIGIN/../nvidia/cudnn/lib", "$ORIGIN/../nvidia/cu13/lib", dn["cudnn_lib"], dn["nvrtc_lib"]]
            cmd = [cu["nvcc"], "-shared", "-o", os.path.join(out_dir, "libfasttran_cudnn.so"), cudnn_obj,
                   cudart_static, "-L" + dn["cudnn_lib"], link_flag(dn["cudnn_lib"], "cudnn"), "-L" + dn["nvrtc_lib"],
                   link_flag(dn["nvrtc_lib"], "nvrtc"), "-ldl", "-lpthread", "-lrt",
                   "-Xlinker", "--no-undefined", "-Xlinker", "-rpath=" + ":".join(rpaths)]
            print(" ".join(cmd))
            subprocess.run(cmd, check=True)

    def write_build_config(self, out_dir):
        cu = self.cuda
        cfg = {
            "compiler": sysconfig.get_config_var("CC") or "cc",
            "cflags": " ".join(cpu_flags()),
            "numpy_build_version": __import__("numpy").__version__,
            "openblas_build_version": getattr(__import__("scipy_openblas32"), "__version__", "?"),
            "cuda_compiled": bool(cu),
            "cuda_build_reason": cu["reason"] if cu else cuda_env.want_nvcc_build()[1],
            "cuda_emulator": bool(self.emu),
            "cuda_version": cu["version"] if cu else None,
            "cuda_archs": cu["archs"] if cu else [],
            "cublas_source": cu["cublas_source"] if cu else None,
            # cuDNN attention (libfasttran_cudnn.so): "built", or why not
            "cudnn_attention_build": (cu["cudnn_reason"] if cu else "no nvcc build"),
        }
        with open(os.path.join(out_dir, "_build_config.py"), "w") as f:
            f.write("# generated by setup.py at build time\nBUILD = %r\n" % (cfg,))


def make_extension():
    import numpy
    import scipy_openblas32 as ob

    libdir = ob.get_lib_dir()
    link = ["-fopenmp", f"-L{libdir}", f"-l{ob.get_library()}",
            # installed: site-packages/fasttran/_C.so -> site-packages/scipy_openblas32/lib
            "-Wl,-rpath,$ORIGIN/../scipy_openblas32/lib", f"-Wl,-rpath,{libdir}"]
    if os.environ.get("FASTTRAN_SANITIZE") == "address":
        link.append("-fsanitize=address")
    return Extension(
        "fasttran._C",
        sources=c_sources(),
        include_dirs=[os.path.join(CSRC), os.path.join(CSRC, "include"), numpy.get_include(), ob.get_include_dir()],
        extra_compile_args=cpu_flags(),
        extra_link_args=link,
        define_macros=[],
        depends=sorted(glob.glob(os.path.join(CSRC, "**", "*.h"), recursive=True)),
    )


def install_requires():
    """Runtime dependencies: the nvidia-cublas wheel when the nvcc build links the wheel's cuBLAS
    (decided without failing: pip calls this before it has installed the build requirements)."""
    deps = list(BASE_DEPS)
    if cuda_env.want_nvcc_build()[0]:
        nvcc = cuda_env.find_nvcc()
        if nvcc and (cuda_env.find_cublas(os.path.dirname(os.path.dirname(nvcc))) or ("", "", ""))[2] != "toolkit":
            deps.append(cuda_env.cublas_wheel_name(nvcc))
        if cuda_env.cudnn_requested():   # FASTTRAN_CUDNN=1: cuDNN attention's wheels at run time too
            deps += cuda_env.CUDNN_WHEELS
    return deps


setup(
    ext_modules=[make_extension()],
    cmdclass={"build_ext": FastTranBuildExt},
    install_requires=install_requires(),
)

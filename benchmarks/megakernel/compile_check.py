"""Compile the megakernel sources for sm_90a on a machine without a GPU (NVRTC 13 from PyPI), print ptxas's register
and shared-memory use, and optionally disassemble (nvdisasm from PyPI):

    pip download --no-deps -d /tmp/nvrtc "nvidia-cuda-nvrtc>=13" "nvidia-cuda-nvdisasm>=13"
    (cd /tmp/nvrtc && for f in *.whl; do python -m zipfile -e $f x/; done; chmod +x x/nvidia/cu13/bin/nvdisasm)
    python benchmarks/megakernel/compile_check.py "flow_chain::chain<5, 2, 0, true>" [--sass OUT.sass]

The code is ring_chain.cu, flow_common.cu, flow_attention.cu and flow_chain.cu, as flow_chain.py compiles it."""
import argparse
import ctypes
import subprocess
from pathlib import Path

HERE = Path(__file__).parent
ROOT = Path("/tmp/nvrtc/x/nvidia/cu13")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="+")
    parser.add_argument("--sass", help="write the disassembly here")
    parser.add_argument("-D", action="append", default=[], help="NAME=VALUE, a #define before the code (layer_chain.py's DEFINES)")
    args = parser.parse_args()
    lib = ctypes.CDLL(str(ROOT / "lib" / "libnvrtc.so.13"))
    code = "".join(f"#define {d.replace('=', ' ')}\n" for d in args.D) + "".join((HERE / name).read_text() for name in ("ring_chain.cu", "flow_common.cu", "flow_attention.cu", "flow_chain.cu"))
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), b"chain.cu", 0, None, None) == 0
    for name in args.names:
        assert lib.nvrtcAddNameExpression(prog, name.encode()) == 0
    include = HERE.parents[1] / "kernels" / "runtime_kernels" / "cuda"
    opts = [b"-std=c++17", b"-arch=sm_90a", f"-I{include}".encode(), b"-Xptxas=-v"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    print("\n".join(line for line in log.value.decode().splitlines() if "error" in line or "Used" in line or "spill" in line or "Function properties" in line))
    if rc != 0:
        raise SystemExit(f"compile failed (nvrtc {rc})")
    if args.sass:
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        path = Path(args.sass).with_suffix(".cubin")
        path.write_bytes(cubin.raw)
        Path(args.sass).write_text(subprocess.run([str(ROOT / "bin" / "nvdisasm"), "-c", str(path)], check=True,
                                                  capture_output=True, text=True).stdout)


if __name__ == "__main__":
    main()

"""Rewrites a CUDA source of csrc/cuda as C++ for the host emulation (cuda_host.h):

    kernel<T><<<grid, block, smem, stream>>>(args)
        -> ::cuda_host::launch(grid, block, smem, stream)(kernel<T>, args)
    extern __shared__ T name[];
        -> T* name = ::cuda_host::dynamic_shared<T>();
    #pragma unroll [N]
        -> (an empty line: an unrolling hint changes no result, and GCC does not know nvcc's)

Usage: hostify.py SOURCE.cu OUTPUT.cc. Everything else is left to the fake CUDA headers; a
launch or dynamic shared array this script cannot rewrite fails the build (nvcc syntax would
remain).
"""
import re
import sys

LAUNCH = re.compile(r"([A-Za-z_]\w*(?:<[^;(){}]*?>)?)\s*<<<(.*?)>>>\s*\(", re.S)
SHARED = re.compile(r"extern\s+__shared__\s+(\w+)\s+(\w+)\s*\[\s*\]\s*;")
UNROLL = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+unroll\b[^\n]*$", re.M)


def hostify(text: str) -> str:
    text = LAUNCH.sub(lambda m: f"::cuda_host::launch({m.group(2)})({m.group(1)}, ", text)
    text = SHARED.sub(lambda m: f"{m.group(1)}* {m.group(2)} = ::cuda_host::dynamic_shared<{m.group(1)}>();",
                      text)
    text = UNROLL.sub("", text)
    for leftover in ("<<<", "extern __shared__"):
        if leftover in text:
            raise SystemExit(f"hostify: cannot rewrite a {leftover} of this source")
    return text


def main() -> None:
    source, output = sys.argv[1], sys.argv[2]
    with open(source) as f:
        text = f.read()
    with open(output, "w") as f:
        f.write(f'#line 1 "{source}"\n' + hostify(text))


if __name__ == "__main__":
    main()

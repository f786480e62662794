"""Build Triton's CUDA driver module (cuda_utils) into TRITON_CACHE_DIR at image build time.

Triton compiles one small C module, backends/nvidia/driver.c, with the system C compiler (and
Python.h) the first time a process touches the GPU, linked against the driver's libcuda.so.1;
everything else it needs at run time ships in its wheel (ptxas, libdevice) or comes from the
host (libcuda.so.1, mounted by the NVIDIA container toolkit). The final image has no compiler,
so the build stage builds that module here, under the cache key the run time computes:

- the same driver.c, include and library directories: TRITON_LIBCUDA_PATH pins the libcuda
  one to where the toolkit mounts the driver (/usr/lib/x86_64-linux-gnu on Debian);
- the same platform key: Python's platform.architecture() asks the `file` program, so both
  stages must have it (or both lack it).

No GPU is needed: the module is only linked here, against a stub libcuda.so.1 that the build
stage makes and the final stage does not copy (linked --no-as-needed, so that the module
records libcuda.so.1 and finds the real one at run time).

    python prewarm_triton.py           # build stage: compile into TRITON_CACHE_DIR
    python prewarm_triton.py --check   # final stage: the run time's lookup hits the cache
"""

from __future__ import annotations

import os
import subprocess
import sys


def cuda_utils_path() -> str:
    """What triton.backends.nvidia.driver.CudaUtils.__init__ compiles (same arguments, so the
    same cache key), without loading it."""
    from triton.backends.nvidia import driver
    from triton.runtime.build import compile_so_from_file

    return compile_so_from_file(
        src_path=os.path.join(driver.dirname, "driver.c"),
        name="cuda_utils",
        library_dirs=driver.library_dirs(),
        include_dirs=driver.include_dirs,
        libraries=driver.libraries,
    )


def main(argv: list[str]) -> int:
    if not os.environ.get("TRITON_LIBCUDA_PATH") or not os.environ.get("TRITON_CACHE_DIR"):
        print(
            "set TRITON_LIBCUDA_PATH and TRITON_CACHE_DIR as the final image does", file=sys.stderr
        )
        return 2
    if argv == ["--check"]:
        os.environ["CC"] = "false"  # a cache miss would compile: make it fail
        try:
            path = cuda_utils_path()
        except (subprocess.CalledProcessError, OSError) as exc:
            print(f"triton cuda_utils is not in the cache ({exc})", file=sys.stderr)
            return 1
        print(f"triton cuda_utils found in the cache: {path}")
        return 0
    print(f"triton cuda_utils prebuilt: {cuda_utils_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Only the native libraries live here; all other metadata is in pyproject.toml.

Each is a plain C library loaded with ctypes (it uses no Python API; native_library.py
finds and loads them), built as a setuptools Extension so that `pip install` compiles it
wherever a C compiler exists. `optional=True`: without a compiler the install still
succeeds and the tier manager falls back, saying so: the IO engine to Python threads, the
AdamW step to PyTorch's kernel (both slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tierstack.services.tier_manager._blockio",
            sources=["services/tier_manager/native/blockio.c"],
            extra_compile_args=["-O2", "-std=c11", "-D_GNU_SOURCE"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
        Extension(
            "tierstack.services.tier_manager._adamw",
            sources=["services/tier_manager/native/adamw.c"],
            # -O3 vectorises the loops; -ffp-contract=off keeps GCC from fusing any multiply
            # and add that the code does not fuse itself (the rounding must be PyTorch's);
            # -fno-math-errno lets sqrtf become one instruction (its argument is never < 0).
            extra_compile_args=["-O3", "-std=c11", "-D_GNU_SOURCE", "-ffp-contract=off",
                                "-fno-math-errno"],
            extra_link_args=["-pthread"],
            libraries=["m"],
            optional=True,
        ),
    ]
)

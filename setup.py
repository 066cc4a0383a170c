"""Only the native block-IO loop lives here; all other metadata is in pyproject.toml.

The extension is a plain C library loaded with ctypes (it uses no Python API), built as
a setuptools Extension so that `pip install` compiles it wherever a C compiler exists.
`optional=True`: without a compiler the install still succeeds and the IO engine falls
back to Python threads (slower; it logs a warning).
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
        )
    ]
)

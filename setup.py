from setuptools import setup

setup(
    name="inkling-compiled",
    version="0.1.0",
    description="A compiled decode engine for Inkling text models",
    python_requires=">=3.10",
    # custom_ops/ and graphs/ live at the top of the repo but install inside the package,
    # so nothing but `inkling_compiled` lands in site-packages.
    packages=["inkling_compiled", "inkling_compiled.custom_ops", "inkling_compiled.custom_ops.gpu",
              "inkling_compiled.graphs", "inkling_compiled.parallel", "inkling_compiled.server",
              "inkling_compiled.spec"],
    package_dir={
        "inkling_compiled": "inkling_compiled",
        "inkling_compiled.custom_ops": "custom_ops",
        "inkling_compiled.custom_ops.gpu": "custom_ops/gpu",
        "inkling_compiled.graphs": "graphs",
    },
    # triton: the CUDA kernels, and (with numpy) their interpreter on CPU, where the tests run them.
    install_requires=["torch>=2.13", "msgspec", "safetensors", "nvtx", "tokenizers", "ninja", "numpy",
                      "triton==3.7.1; platform_system == \"Linux\" and platform_machine == \"x86_64\""],
    # The C++ CPU kernels are compiled on first use (torch.utils.cpp_extension), so their source ships.
    # The shipped trained checkpoint (tools/train_tiny.py): weights, tokenizer, model card, corpus record.
    package_data={"inkling_compiled.custom_ops": ["csrc/*.cpp"], "inkling_compiled": ["trained/pystd/*"]},
    extras_require={
        "test": ["pytest", "transformers==5.23.0", "numpy", "fastapi>=0.110", "uvicorn>=0.29", "openai>=1.40",
                 "httptools>=0.6", "uvloop>=0.19; sys_platform != \"win32\""],
        # The OpenAI-compatible HTTP server (`inkling-compiled serve`); httptools and uvloop are uvicorn's
        # fast parser and event loop, which it takes when they are installed.
        "serve": ["fastapi>=0.110", "uvicorn>=0.29", "httptools>=0.6", "uvloop>=0.19; sys_platform != \"win32\""],
        # `bench-serve --client aiperf`: an OpenAI-compatible benchmark client (about 100 packages of its
        # own; a venv of its own keeps them apart, and `--aiperf PATH` finds it there).
        "aiperf": ["aiperf==0.13.0"],
        "bench": ["transformers==5.23.0", "matplotlib"],
        # GPU only: its TensorRT libraries cannot be installed on CPU machines.
        "tensorrt": ["torch-tensorrt==2.13.*"],
    },
    entry_points={"console_scripts": ["inkling-compiled=inkling_compiled.cli:main"]},
)

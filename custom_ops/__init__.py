"""Short-conv and cache kernels (installed as `inkling_compiled.custom_ops`).

`reference` holds the plain-torch definition of each kernel's math.
"""

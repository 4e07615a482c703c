"""Triton kernels: the CUDA implementation of every `inkling` op but `linear` (cuBLAS) and `wait_layer`.

Each module holds the `@triton.jit` kernels of one op family and a launcher with the op's signature;
`library.define` registers the launcher, imported on the first CUDA call (`gpu_kernel`), as the op's
CUDA kernel. Dynamo sees the op, never the kernel, so the op stays the unit of the census.

Rules every kernel here keeps, so that a decode step can be recorded as a CUDA graph:
- no host sync: nothing reads a tensor's values on the host (no `.item()`, `.tolist()`, `nonzero`),
  and every shape, grid and scratch buffer is a function of the inputs' shapes only;
- arithmetic in fp32 whatever the storage dtype (loads are upcast, stores cast back), which is also
  what keeps them exact under `TRITON_INTERPRET=1`: the interpreter's bf16 arithmetic is not;
- only what both triton 3.6 (torch 2.11) and 3.7 (torch 2.13) have.

Under `TRITON_INTERPRET=1` (set before this package is imported) the same kernels run on CPU tensors
through numpy: that is how CPU CI checks them against the reference kernels.
"""

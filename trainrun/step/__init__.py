"""The step's runtime on one rank: the onnxruntime sessions (`engine`, `sessions`, `cuda`, `cuda_kernels`), the flat
buffers (`flat`), what feeds the graphs (`feeding`, `dropout`), the optimizer (`optim`), the learning rate
(`schedule`) and fp16 loss scaling (`precision`)."""

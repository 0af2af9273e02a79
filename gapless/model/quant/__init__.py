"""How a linear layer holds its weight and computes `x W^T + b`: one linear method per layer, chosen at
load. `UnquantizedLinearMethod` (`base`) is every layer's default: the float weight the layer holds, on
every device, with tensor parallelism. `gguf_cpu` keeps a GGUF file's quantized matrices quantized on the
CPU, through torch's weight-only int4/int8 kernels. `int4` keeps AWQ, GPTQ and compressed-tensors
`pack-quantized` checkpoints' int4/int8 weights quantized (the Triton GEMM of `int4_triton` on CUDA, a
dequantizing reference path elsewhere). Other formats (FP8) are further methods beside these; the layers
only ever call `linear_method.apply(layer, x)`."""

from gapless.model.quant.base import LinearMethod, UnquantizedLinearMethod, weights_held, weights_summary

__all__ = ["LinearMethod", "UnquantizedLinearMethod", "weights_held", "weights_summary"]

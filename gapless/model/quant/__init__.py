"""How a linear layer holds its weight and computes `x W^T + b`: one linear method per layer, chosen at load.
`UnquantizedLinearMethod` (`base`) is every layer's default: the float weight the layer holds, on every
device, with tensor parallelism. A GGUF file's quantized matrices (`gguf_blocks`) stay quantized: on a
one-rank CPU in `gguf_cpu`'s layers (torch's CPU int4/int8 kernels), on a GPU and across ranks on the
int4/int8 path (`gguf_int4`). `formats` reads which format a checkpoint (or `--quantization`)
asks for, before any weight loads, and names the module that loads it: `fp8` (e4m3 W8A8, its Triton GEMM in
`fp8_kernel`), `int4` (AWQ, GPTQ and compressed-tensors `pack-quantized`/`int-quantized` int4/int8
weight-only, the Triton GEMM of `int4_triton` on CUDA, a dequantizing reference path elsewhere). The layers
only ever call `linear_method.apply(layer, x)`."""

from gapless.model.quant.base import (
    LinearMethod,
    UnquantizedLinearMethod,
    quantization,
    weights_held,
    weights_summary,
)

__all__ = [
    "LinearMethod",
    "UnquantizedLinearMethod",
    "quantization",
    "weights_held",
    "weights_summary",
]

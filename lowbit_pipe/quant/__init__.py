"""The quantized layer (nn.QuantLinear: buffers are exactly the on-disk tensors) and GPTQ."""

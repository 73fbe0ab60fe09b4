"""Weight-only quantization (`runtime.quant=int8|int4`, `runtime.quant_group` for int4).

    build on meta -> quantize_linears (QuantLinear in place of eligible nn.Linear) -> plan load
      -> every weight quantized as it is read (one tensor at a time), or GGUF blocks kept as they are

One mechanism for every family: any `nn.Linear` of any kind may be replaced by a `QuantLinear`
(linear.py), which computes the same forward(x) [..., I] -> [..., O] from quantized buffers with
torch's weight-only kernels; stacked MoE experts become QuantExperts (experts.py), one op per
stack over the chosen experts. What stays floating point, and why, is decided in apply.py and listed
in the build report: embeddings, norms, routers (they are no nn.Linear), linears inside
contracts.KeepFloat32 modules, small projections, and the linears a kind reads `.weight` of directly
(it names them in `float_linears`, see contracts.FloatLinears).
"""

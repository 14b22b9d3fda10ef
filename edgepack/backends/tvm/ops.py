"""ONNX operators the TVM (relax) path builds for static shapes.

A subset of the relax ONNX frontend's converters: ops whose output shapes do not depend on the
data (NonZero, Unique, NMS... need dynamic shapes, which edgepack artifacts do not have), no
sequences/optionals, no quantized ops. Kept true by tests/test_tvm_ops.py, which checks the table
against the installed frontend's converter map and compiles and runs single-op models for a
sample (including the ops NCNN lacks) against onnxruntime.
"""

SUPPORTED = frozenset({
    # convolution / pooling / normalisation
    "Conv", "ConvTranspose", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "LpPool",
    "GlobalLpPool", "BatchNormalization", "InstanceNormalization", "LayerNormalization", "GroupNormalization",
    "LRN", "MeanVarianceNormalization", "RMSNormalization",
    # activations
    "Relu", "LeakyRelu", "PRelu", "Elu", "Selu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Softplus",
    "Softsign", "Mish", "Gelu", "Clip", "Softmax", "LogSoftmax", "Hardmax", "Erf", "ThresholdedRelu", "Shrink",
    # element-wise arithmetic and math
    "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Exp", "Log", "Abs", "Neg", "Reciprocal", "Floor", "Ceil",
    "Round", "Sign", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh",
    "Min", "Max", "Mean", "Sum", "Mod", "IsInf", "IsNaN",
    # comparison and logic
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor", "Not", "Where",
    "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot",
    # linear algebra
    "MatMul", "Gemm", "Einsum",
    # shape and layout
    "Reshape", "Flatten", "Transpose", "Concat", "Split", "Slice", "Squeeze", "Unsqueeze", "Pad", "Resize",
    "Upsample", "DepthToSpace", "SpaceToDepth", "Tile", "Expand", "Trilu", "EyeLike",
    # indexing, sorting, scans
    "Gather", "GatherElements", "GatherND", "ScatterElements", "ScatterND", "TopK", "ArgMax", "ArgMin",
    "CumSum", "OneHot",
    # reductions
    "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "ReduceSumSquare",
    # graph plumbing (folded or trivial)
    "Identity", "Dropout", "Constant", "ConstantOfShape", "Shape", "Size", "Cast", "CastLike", "Range",
})

# Ops the frontend converts but edgepack does not offer through TVM (data-dependent shapes,
# sequences, quantisation): reported by `inspect` and `--backend auto` before compiling.
EXCLUDED = frozenset({
    "NonZero", "Unique", "NonMaxSuppression", "AllClassNMS", "Compress", "Optional", "OptionalHasElement",
    "OptionalGetElement", "SequenceAt", "SequenceConstruct", "SequenceEmpty", "SequenceErase", "SequenceInsert",
    "SequenceLength", "SplitToSequence", "ConcatFromSequence", "QuantizeLinear", "DequantizeLinear",
    "DynamicQuantizeLinear", "MatMulInteger", "MatMulInteger16", "MaxRoiPool", "RoiAlign", "MaxUnpool",
    "GridSample", "AffineGrid", "Scatter", "Attention", "BiasGelu", "EmbedLayerNormalization", "FastGelu",
    "SkipLayerNormalization",
})


# Ops the frontend lacks that compile.import_onnx rewrites first (edgepack.onnx_lstm unrolls them
# over the static sequence length); a node the rewrite refuses (see onnx_lstm.refusal) stays unsupported.
DECOMPOSED = frozenset({"LSTM", "GRU"})


def unsupported(ops: dict[str, list[str]], proto=None) -> dict[str, list[str]]:
    """op -> nodes TVM cannot build; LSTM/GRU nodes count as buildable when, given the model's
    proto, the rewrite takes them (without it, they count as unsupported)."""
    out = {op: nodes for op, nodes in ops.items() if op not in SUPPORTED | DECOMPOSED}
    recurrent = DECOMPOSED & ops.keys()
    if recurrent:
        from ...onnx_lstm import decomposable
        ok = decomposable(proto) if proto is not None else set()
        for op in sorted(recurrent):
            bad = [n for n in ops[op] if n not in ok]
            if bad:
                out[op] = bad
    return out

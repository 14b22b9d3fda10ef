"""ONNX operators the pnnx -> ncnn path builds (after onnxsim has folded shape arithmetic).

Kept true by tests/test_op_coverage.py, which converts single-op models for a sample of each
list. Ops outside the table are reported before conversion; the converted .param is checked
again against ncnn's own layer registry, and outputs against onnxruntime.
"""

SUPPORTED = frozenset({
    # convolution / pooling / normalisation
    "Conv", "ConvTranspose", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool",
    "BatchNormalization", "InstanceNormalization", "LayerNormalization", "GroupNormalization", "LRN",
    # activations
    "Relu", "LeakyRelu", "PRelu", "Elu", "Selu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Softplus",
    "Mish", "Gelu", "Clip", "Softmax", "LogSoftmax", "Erf",
    # element-wise arithmetic
    "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Exp", "Log", "Abs", "Neg", "Reciprocal", "Floor", "Ceil", "Round",
    "Sin", "Cos", "Min", "Max",
    # linear algebra
    "MatMul", "Gemm", "Einsum",
    # shape and layout
    "Reshape", "Flatten", "Transpose", "Concat", "Split", "Slice", "Squeeze", "Unsqueeze",
    "Resize", "Expand",
    # reductions
    "ReduceMean", "ReduceSum", "ReduceSumSquare",
    # recurrent
    "LSTM", "GRU",
    # graph plumbing that conversion removes
    "Identity", "Dropout", "Constant", "Shape", "Gather", "Cast",
})

# Known to fail in pnnx/ncnn (shared notes): reported with the node name before converting.
KNOWN_UNSUPPORTED = frozenset({
    "TopK", "Where", "GatherElements", "CumSum", "NonZero", "NonMaxSuppression", "ScatterND",
    "ScatterElements", "Loop", "If", "Scan", "ArgMax", "ArgMin", "RoiAlign", "Range", "OneHot",
    "Mod", "Equal", "Less", "Greater", "And", "Or", "Not",
    # found by tests/test_op_coverage.py: no ncnn layer after pnnx, or silently wrong
    "DepthToSpace", "SpaceToDepth", "Tile", "Pad", "ReduceMax",
})

# Listed above as unsupported, yet converted in context: pnnx turns a Pad next to convolutions into
# ncnn Padding (Silero VAD's reflect pad), and a lone constant one once its mode is written out
# (pnnx_forms.pad_mode_explicit), but not an edge Pad with negative pads (tests/test_op_coverage.py).
# These are let through to conversion, whose layer check and onnxruntime comparison decide.
CONVERSION_DECIDES = frozenset({"Pad"})

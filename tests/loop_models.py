"""A small autoregressive decoder as ONNX's Loop, written as Paddle's exporter writes SLANet-plus's:
a trip count and a data-decided stop, a buffer whose row i is written at step i through
``Range(i, i + 1)`` + Tile + ScatterElements, the row read back through ``Slice(buf, i, min(N, i + 1))``,
a write-only carried value that starts as a scalar, invariant weights and a computed invariant (the
encoder's output, projected inside the body as SLANet-plus's attention does), and after the loop a Slice of the buffer up to the step count (the output's length
is the model's answer)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

ROWS, WIDTH = 12, 8


def _c(name: str, value) -> onnx.NodeProto:
    return h.make_node("Constant", [], [name], value=nh.from_array(np.asarray(value), name))


def decoder_model(path, rows_guard: bool = True, seed: int = 5, answer_length: bool = False) -> onnx.ModelProto:
    """``rows_guard`` False: the body's own stop ignores the buffer's length, so a long decode reads
    (Slice) past the last row, where ONNX gives an empty slice and the compiled body a check failure.
    ``answer_length``: the decoded length is a model output too (the cut's own length)."""
    rng = np.random.default_rng(seed)
    w_in = rng.normal(0, 0.6, (WIDTH, WIDTH)).astype(np.float32)
    w_rec = rng.normal(0, 0.9, (WIDTH, WIDTH)).astype(np.float32)
    f32 = lambda n, s: h.make_tensor_value_info(n, T.FLOAT, s)  # noqa: E731
    body_nodes = [
        _c("one_f", np.float32(1.0)), _c("rows", np.asarray([ROWS], np.int64)), _c("axes1", np.asarray([1], np.int64)),
        _c("shape111", np.asarray([1, 1, 1], np.int64)), _c("tile", np.asarray([1, 1, WIDTH], np.int64)),
        _c("zero_i", np.asarray(0, np.int64)), _c("limit", np.asarray([ROWS], np.int64)),
        # the step's counter through a float round trip, as Paddle writes it
        h.make_node("Cast", ["count"], ["count_f"], to=T.FLOAT),
        h.make_node("Add", ["count_f", "one_f"], ["next_f"]),
        h.make_node("Cast", ["next_f"], ["next"], to=T.INT64),
        h.make_node("Min", ["rows", "next"], ["end"]),
        h.make_node("Slice", ["buf", "count", "end", "axes1"], ["prev"]),          # row i (zeros until written)
        h.make_node("ReduceSum", ["prev", "axes1"], ["prev_sum"], keepdims=0),
        h.make_node("MatMul", ["state", "w_rec"], ["rec"]),
        h.make_node("MatMul", ["enc", "w_rec"], ["enc_proj"]),                  # the same at every step: hoisted
        h.make_node("Add", ["rec", "enc_proj"], ["pre0"]),
        h.make_node("Add", ["pre0", "prev_sum"], ["pre"]),
        h.make_node("Tanh", ["pre"], ["state_next"]),
        # row i of the buffer := the new state
        h.make_node("Squeeze", ["count"], ["count_s"]),
        h.make_node("Squeeze", ["next"], ["next_s"]),
        h.make_node("Range", ["count_s", "next_s", "one_i"], ["row_ids"]),
        h.make_node("Reshape", ["row_ids", "shape111"], ["row_ids3"]),
        h.make_node("Tile", ["row_ids3", "tile"], ["idx"]),
        h.make_node("Unsqueeze", ["state_next", "axes1"], ["upd"]),
        h.make_node("ScatterElements", ["buf", "idx", "upd"], ["buf_next"], axis=1),
        h.make_node("Identity", ["buf_next"], ["out_next"]),                       # write-only: starts as a scalar
        # stop at token 0 (the state's argmax), or at the buffer's end
        h.make_node("ArgMax", ["state_next"], ["token"], axis=1, keepdims=0),
        h.make_node("Equal", ["token", "zero_tok"], ["eos"]),
        h.make_node("Not", ["eos"], ["going"]),
        h.make_node("Less", ["next", "limit"], ["room"]),
        h.make_node("And", ["going", "room"] if rows_guard else ["going", "going"], ["cond_vec"]),
        h.make_node("Reshape", ["cond_vec", "scalar"], ["cond_next"]),
        h.make_node("Identity", ["next"], ["count_next"]),
    ]
    body_inits = [nh.from_array(np.asarray(1, np.int64), "one_i"), nh.from_array(np.asarray([0], np.int64), "zero_tok"),
                  nh.from_array(np.asarray([], np.int64), "scalar")]
    body = h.make_graph(
        body_nodes, "decoder_step",
        [h.make_tensor_value_info("i", T.INT64, []), h.make_tensor_value_info("cond", T.BOOL, []),
         f32("state", [1, WIDTH]), h.make_tensor_value_info("count", T.INT64, [1]), f32("buf", [1, ROWS, WIDTH]),
         f32("out", None), f32("w_rec", [WIDTH, WIDTH]), f32("enc", [1, WIDTH])],
        [h.make_tensor_value_info("cond_next", T.BOOL, []), f32("state_next", [1, WIDTH]),
         h.make_tensor_value_info("count_next", T.INT64, [1]), f32("buf_next", [1, ROWS, WIDTH]),
         f32("out_next", [1, ROWS, WIDTH]), f32("w_rec", [WIDTH, WIDTH]), f32("enc", [1, WIDTH])],
        initializer=body_inits)
    nodes = [
        h.make_node("MatMul", ["x", "w_in"], ["enc0"]),
        h.make_node("Relu", ["enc0"], ["enc"]),
        h.make_node("Loop", ["max_steps", "go", "state0", "count0", "buf0", "out0", "w_rec", "enc"],
                    ["state_f", "count_f", "buf_f", "out_f", "w_rec_f", "enc_f"], body=body),
        h.make_node("Reshape", ["count_f", "vec"], ["length"]),
        h.make_node("Slice", ["out_f", "start0", "length", "axes1o"], ["rows_used"]),
        h.make_node("Softmax", ["rows_used"], ["probs"], axis=-1),
    ]
    inits = [nh.from_array(w_in, "w_in"), nh.from_array(w_rec, "w_rec"),
             nh.from_array(np.asarray(100, np.int64), "max_steps"), nh.from_array(np.asarray(True), "go"),
             nh.from_array(np.zeros((1, WIDTH), np.float32), "state0"), nh.from_array(np.zeros(1, np.int64), "count0"),
             nh.from_array(np.zeros((1, ROWS, WIDTH), np.float32), "buf0"), nh.from_array(np.float32(0), "out0"),
             nh.from_array(np.asarray([1], np.int64), "vec"), nh.from_array(np.asarray([0], np.int64), "start0"),
             nh.from_array(np.asarray([1], np.int64), "axes1o")]
    outputs = [f32("probs", [1, "steps", WIDTH]), f32("state_f", [1, WIDTH])]
    if answer_length:
        outputs.append(h.make_tensor_value_info("length", T.INT64, [1]))
    graph = h.make_graph(nodes, "tiny_decoder", [f32("x", [1, WIDTH])], outputs, inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], producer_name="edgepack-tests")
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return model


def inputs_with_lengths(model_path, count: int = 40, seed: int = 11) -> list[tuple[np.ndarray, int]]:
    """Inputs and onnxruntime's decode length for each, from seeded random draws."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        x = rng.normal(0, 1.5, (1, WIDTH)).astype(np.float32)
        out.append((x, sess.run(["probs"], {"x": x})[0].shape[1]))
    return out


def counted_model(path, seed: int = 6, condition: bool = True) -> onnx.ModelProto:
    """A loop that steps |x[0]| + 1 times (x ~ N(0, 1): a few steps) and reads row i of a 12-row table
    with ``Slice(table, i, min(12, i + 1))``: from step 12 on onnxruntime's slice is empty (the loop goes
    on with a zero sum), while the compiled body's fixed length no longer holds and the artifact must
    stop with an error rather than answer otherwise."""
    rng = np.random.default_rng(seed)
    f32 = lambda n, s: h.make_tensor_value_info(n, T.FLOAT, s)  # noqa: E731
    body = h.make_graph([
        _c("one_f", np.float32(1.0)), _c("rows", np.asarray([ROWS], np.int64)), _c("axes1", np.asarray([1], np.int64)),
        h.make_node("Cast", ["count"], ["count_f"], to=T.FLOAT),
        h.make_node("Add", ["count_f", "one_f"], ["next_f"]),
        h.make_node("Cast", ["next_f"], ["next"], to=T.INT64),
        h.make_node("Min", ["rows", "next"], ["end"]),
        h.make_node("Slice", ["table", "count", "end", "axes1"], ["row"]),
        h.make_node("ReduceSum", ["row", "axes1"], ["row_sum"], keepdims=0),
        h.make_node("MatMul", ["state", "w"], ["rec"]),
        h.make_node("Add", ["rec", "row_sum"], ["pre"]),
        h.make_node("Tanh", ["pre"], ["state_next"]),
        h.make_node("Less", ["next", "limit"], ["more"]),
        h.make_node("Squeeze", ["more"], ["cond_next"]),
        h.make_node("Identity", ["next"], ["count_next"]),
    ], "counted_step",
        [h.make_tensor_value_info("i", T.INT64, []), h.make_tensor_value_info("cond", T.BOOL, []),
         f32("state", [1, WIDTH]), h.make_tensor_value_info("count", T.INT64, [1]), f32("table", [1, ROWS, WIDTH]),
         h.make_tensor_value_info("limit", T.INT64, [1]), f32("w", [WIDTH, WIDTH])],
        [h.make_tensor_value_info("cond_next", T.BOOL, []), f32("state_next", [1, WIDTH]),
         h.make_tensor_value_info("count_next", T.INT64, [1]), f32("table", [1, ROWS, WIDTH]),
         h.make_tensor_value_info("limit", T.INT64, [1]), f32("w", [WIDTH, WIDTH])])
    nodes = [
        h.make_node("Slice", ["x", "zero1", "one1", "one1"], ["x0"]),            # x[:, 0:1]
        h.make_node("Abs", ["x0"], ["x0_abs"]), h.make_node("Floor", ["x0_abs"], ["x0_floor"]),
        h.make_node("Cast", ["x0_floor"], ["x0_int"], to=T.INT64),
        h.make_node("Reshape", ["x0_int", "one1"], ["steps"]),
        h.make_node("Add", ["steps", "one1"], ["limit"]),
        h.make_node("MatMul", ["x", "w_t"], ["t0"]),
        h.make_node("Reshape", ["t0", "t_shape"], ["t1"]),
        h.make_node("Expand", ["t1", "table_shape"], ["table"]),
        # ``condition`` False: no condition input, where ONNX ignores the body's and onnxruntime does not
        h.make_node("Loop", ["max_steps", "go" if condition else "", "state0", "count0", "table", "limit", "w"],
                    ["state_f", "count_f", "table_f", "limit_f", "w_f"], body=body),
    ]
    inits = [nh.from_array(rng.normal(0, 0.5, (WIDTH, WIDTH)).astype(np.float32), "w"),
             nh.from_array(rng.normal(0, 0.5, (WIDTH, WIDTH)).astype(np.float32), "w_t"),
             nh.from_array(np.asarray([1, 1, WIDTH], np.int64), "t_shape"),
             nh.from_array(np.asarray([1, ROWS, WIDTH], np.int64), "table_shape"),
             nh.from_array(np.asarray([0], np.int64), "zero1"), nh.from_array(np.asarray([1], np.int64), "one1"),
             nh.from_array(np.asarray(100, np.int64), "max_steps"), nh.from_array(np.asarray(True), "go"),
             nh.from_array(np.zeros((1, WIDTH), np.float32), "state0"), nh.from_array(np.zeros(1, np.int64), "count0")]
    graph = h.make_graph(nodes, "counted", [f32("x", [1, WIDTH])], [f32("state_f", [1, WIDTH])], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], producer_name="edgepack-tests")
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return model


def doubling_model(path) -> onnx.ModelProto:
    """A graph that is one Loop and nothing else: x doubled (or zeroed, by an If in the body, when its
    sum is not positive) until its sum passes 100, at most 50 steps."""
    t = lambda name, shape=(): h.make_tensor_value_info(name, T.FLOAT, list(shape))  # noqa: E731
    branch = lambda name, op: h.make_graph([h.make_node(op, ["v_in", "v_in"], [name])], name, [],  # noqa: E731
                                           [t(name, [4])])
    body = h.make_graph(
        [h.make_node("ReduceSum", ["v_in"], ["s"], keepdims=0), h.make_node("Greater", ["s", "zero"], ["pos"]),
         h.make_node("If", ["pos"], ["v_out"], then_branch=branch("t", "Add"), else_branch=branch("e", "Sub")),
         h.make_node("ReduceSum", ["v_out"], ["s2"], keepdims=0), h.make_node("Less", ["s2", "limit"], ["go"])],
        "body", [h.make_tensor_value_info("i", T.INT64, []), h.make_tensor_value_info("c", T.BOOL, []), t("v_in", [4])],
        [h.make_tensor_value_info("go", T.BOOL, []), t("v_out", [4])],
        [h.make_tensor(n, T.FLOAT, [], [v]) for n, v in (("zero", 0.0), ("limit", 100.0))])
    graph = h.make_graph(
        [h.make_node("Loop", ["steps", "cond", "x"], ["y"], body=body)], "doubling", [t("x", [4])], [t("y", [4])],
        [h.make_tensor("steps", T.INT64, [], [50]), h.make_tensor("cond", T.BOOL, [], [True])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return model

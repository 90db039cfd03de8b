"""A small single-shot detection head built with onnx.helper, shaped like
SSD's post-processing: a convolutional head over a feature map, box
decoding against anchors, a TopK pre-selection, NonMaxSuppression, and
Gathers that pick the kept boxes, scores and labels, whose count depends
on the data.

    >>> model = detection_head()                         # doctest: +SKIP
    >>> boxes, scores, labels = reference(model, {"features": detection_input()})  # doctest: +SKIP
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SIDE = 8          # the feature map is SIDE x SIDE
CHANNELS = 8      # of the feature map
ANCHORS = 2       # per pixel
CLASSES = 3
CANDIDATES = 32   # boxes TopK keeps before NMS
MAX_PER_CLASS = 10


def _anchors() -> np.ndarray:
    """[1, boxes, 4] anchors (x centre, y centre, width, height) on the grid,
    in the order the head's outputs are flattened: pixel, then anchor."""
    rows = []
    for y in range(SIDE):
        for x in range(SIDE):
            for a in range(ANCHORS):
                size = 0.15 * (a + 1)
                rows.append(((x + 0.5) / SIDE, (y + 0.5) / SIDE, size, size))
    return np.asarray(rows, dtype=np.float32)[None]


def detection_head(seed: int = 0, opset: int = 13) -> onnx.ModelProto:
    """features [1, CHANNELS, SIDE, SIDE] -> boxes [n, 4] (x1, y1, x2, y2),
    scores [n] and labels [n] (int64) of the n boxes NMS keeps."""
    rng = np.random.default_rng(seed)
    boxes_n = SIDE * SIDE * ANCHORS
    inits = {
        "cls_w": (0.15 * rng.standard_normal((ANCHORS * CLASSES, CHANNELS, 3, 3))).astype(np.float32),
        "cls_b": (0.1 * rng.standard_normal(ANCHORS * CLASSES) - 1.0).astype(np.float32),
        "reg_w": (0.05 * rng.standard_normal((ANCHORS * 4, CHANNELS, 3, 3))).astype(np.float32),
        "reg_b": np.zeros(ANCHORS * 4, np.float32),
        "anchors": _anchors(),
        "cls_shape": np.array([1, boxes_n, CLASSES], np.int64),
        "reg_shape": np.array([1, boxes_n, 4], np.int64),
        "half": np.array([0.5], np.float32),
        "k": np.array([CANDIDATES], np.int64),
        "most": np.array([MAX_PER_CLASS], np.int64),
        "iou": np.array([0.4], np.float32),
        "score_min": np.array([0.6], np.float32),
        "zero": np.array(0, np.int64),
        "one": np.array(1, np.int64),
        "two": np.array(2, np.int64),
        "flat": np.array([-1], np.int64),
        "width": np.array(CANDIDATES, np.int64),
        "label_base": np.array(1, np.int64),
    }
    n = helper.make_node
    nodes = [
        n("Conv", ["features", "cls_w", "cls_b"], ["cls"], pads=[1, 1, 1, 1]),
        n("Conv", ["features", "reg_w", "reg_b"], ["reg"], pads=[1, 1, 1, 1]),
        # [1, A*C, H, W] -> [1, H*W*A, C], and the same for the 4 box offsets.
        n("Transpose", ["cls"], ["cls_t"], perm=[0, 2, 3, 1]),
        n("Reshape", ["cls_t", "cls_shape"], ["logits"]),
        n("Transpose", ["reg"], ["reg_t"], perm=[0, 2, 3, 1]),
        n("Reshape", ["reg_t", "reg_shape"], ["deltas"]),
        n("Sigmoid", ["logits"], ["probs"]),
        # Decoding: centre = anchor centre + delta * anchor size, size = anchor size * exp(delta).
        n("Split", ["deltas"], ["d_centre", "d_size"], axis=2, num_outputs=2) if opset >= 18 else
        n("Split", ["deltas"], ["d_centre", "d_size"], axis=2),
        n("Split", ["anchors"], ["a_centre", "a_size"], axis=2, num_outputs=2) if opset >= 18 else
        n("Split", ["anchors"], ["a_centre", "a_size"], axis=2),
        n("Mul", ["d_centre", "a_size"], ["shift"]),
        n("Add", ["a_centre", "shift"], ["centre"]),
        n("Exp", ["d_size"], ["grow"]),
        n("Mul", ["a_size", "grow"], ["size"]),
        n("Mul", ["size", "half"], ["half_size"]),
        n("Sub", ["centre", "half_size"], ["low"]),
        n("Add", ["centre", "half_size"], ["high"]),
        n("Concat", ["low", "high"], ["decoded"], axis=2),
        # The CANDIDATES boxes of highest score in any class go on to NMS.
        n("ReduceMax", ["probs"], ["best"], axes=[2], keepdims=0),
        n("TopK", ["best", "k"], ["top_scores", "top"]),
        n("Squeeze", ["top"], ["top_flat"], axes=[0]) if opset < 13 else n("Squeeze", ["top", "zero_axes"], ["top_flat"]),
        n("Gather", ["decoded", "top_flat"], ["cand_boxes"], axis=1),
        n("Gather", ["probs", "top_flat"], ["cand_probs"], axis=1),
        n("Transpose", ["cand_probs"], ["cand_scores"], perm=[0, 2, 1]),
        n("NonMaxSuppression", ["cand_boxes", "cand_scores", "most", "iou", "score_min"], ["selected"]),
        # selected rows are (batch, class, box): pick each kept box, its score and its label.
        n("Gather", ["selected", "one"], ["sel_class"], axis=1),
        n("Gather", ["selected", "two"], ["sel_box"], axis=1),
        n("Gather", ["cand_boxes", "zero"], ["boxes_one"], axis=0),
        n("Gather", ["boxes_one", "sel_box"], ["boxes"], axis=0),
        n("Reshape", ["cand_scores", "flat"], ["scores_flat"]),
        n("Mul", ["sel_class", "width"], ["row_start"]),
        n("Add", ["row_start", "sel_box"], ["score_at"]),
        n("Gather", ["scores_flat", "score_at"], ["scores"], axis=0),
        n("Add", ["sel_class", "label_base"], ["labels"]),
    ]
    if opset >= 13:
        inits["zero_axes"] = np.array([0], np.int64)
    graph = helper.make_graph(
        nodes, "detection_head",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [1, CHANNELS, SIDE, SIDE])],
        [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, ["n", 4]),
         helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["n"]),
         helper.make_tensor_value_info("labels", TensorProto.INT64, ["n"])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    return model


def detection_input(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, CHANNELS, SIDE, SIDE)).astype(np.float32)


def torchvision_postprocess(boxes_n: int = 24, classes: int = 4, per_class: int = 5, keep: int = 6,
                            threshold: float = 0.3) -> onnx.ModelProto:
    """The post-processing torchvision's SSD exports (TorchScript exporter),
    on scores [boxes_n, classes] (class 0 the background) and decoded boxes
    [boxes_n, 4]: per class, the scores above threshold (x[mask], two
    NonZero of one mask), the best min(per_class, found) of them by a TopK
    whose k comes from their Shape, their boxes, and labels by a
    ConstantOfShape of that Shape; the classes concatenated; then, unless
    nothing was found (an If on the boxes' element count), NMS over boxes
    offset per class by (largest coordinate + 1) x label (batched_nms);
    the first `keep` kept; the boxes scaled column by column."""
    n = helper.make_node
    inits = {"threshold": np.array(threshold, np.float32), "zero": np.array(0, np.int64),
             "axis0": np.array([0], np.int64), "axis1": np.array([1], np.int64),
             "per_class": np.array([per_class], np.int64), "one_shape": np.array([1], np.int64),
             "empty": np.array(0, np.int64), "start": np.array([0], np.int64), "keep": np.array([keep], np.int64),
             "ones4": np.array([1, 1, 1, 1], np.int64), "two": np.array([2], np.int64),
             "scale": np.array(2.0, np.float32)}
    nodes, picked, tops, labels = [], [], [], []
    for c in range(1, classes):
        p = f"c{c}/"
        inits[p + "index"] = np.array(c, np.int64)
        nodes += [
            n("Gather", ["scores", p + "index"], [p + "score"], axis=1),
            n("Greater", [p + "score", "threshold"], [p + "mask"]),
            n("NonZero", [p + "mask"], [p + "nz"]),
            n("Transpose", [p + "nz"], [p + "nz_t"], perm=[1, 0]),
            n("GatherND", [p + "score", p + "nz_t"], [p + "found"]),
            n("NonZero", [p + "mask"], [p + "nz_again"]),
            n("Transpose", [p + "nz_again"], [p + "nz_again_t"], perm=[1, 0]),
            n("GatherND", ["boxes", p + "nz_again_t"], [p + "found_boxes"]),
            n("Shape", [p + "found"], [p + "shape"]),
            n("Gather", [p + "shape", "zero"], [p + "count"], axis=0),
            n("Unsqueeze", [p + "count", "axis0"], [p + "count_1"]),
            n("Concat", ["per_class", p + "count_1"], [p + "choices"], axis=0),
            n("ReduceMin", [p + "choices"], [p + "k_scalar"], keepdims=0),
            n("Reshape", [p + "k_scalar", "one_shape"], [p + "k"]),
            n("TopK", [p + "found", p + "k"], [p + "top", p + "top_index"], axis=-1, largest=1, sorted=1),
            n("Gather", [p + "found_boxes", p + "top_index"], [p + "top_boxes"], axis=0),
            n("Shape", [p + "top"], [p + "top_shape"]),
            n("ConstantOfShape", [p + "top_shape"], [p + "labels"],
              value=numpy_helper.from_array(np.array([c], np.int64))),
        ]
        picked.append(p + "top_boxes")
        tops.append(p + "top")
        labels.append(p + "labels")
    nodes += [n("Concat", picked, ["all_boxes"], axis=0), n("Concat", tops, ["all_scores"], axis=0),
              n("Concat", labels, ["all_labels"], axis=0),
              n("Shape", ["all_boxes"], ["all_shape"]), n("ReduceProd", ["all_shape"], ["elements"], keepdims=0),
              n("Equal", ["elements", "empty"], ["is_empty"]), n("Cast", ["is_empty"], ["none_found"], to=9)]
    none = helper.make_graph([n("Constant", [], ["no_boxes"], value=numpy_helper.from_array(
        np.zeros(0, np.int64)))], "none", [], [helper.make_tensor_value_info("no_boxes", TensorProto.INT64, [0])])
    batched = [
        n("ReduceMax", ["all_boxes"], ["max_coordinate"], keepdims=0),
        n("Cast", ["all_labels"], ["labels_f"], to=1),
        n("Constant", [], ["one_f"], value=numpy_helper.from_array(np.array(1.0, np.float32))),
        n("Add", ["max_coordinate", "one_f"], ["stride"]),
        n("Mul", ["labels_f", "stride"], ["offsets"]),
        n("Constant", [], ["big"], value=numpy_helper.from_array(np.array([2 ** 63 - 1], np.int64))),
        n("Slice", ["offsets", "start", "big", "axis0", "axis1"], ["offsets_all"]),
        n("Unsqueeze", ["offsets_all", "axis1"], ["offsets_col"]),
        n("Add", ["all_boxes", "offsets_col"], ["boxes_for_nms"]),
        n("Unsqueeze", ["boxes_for_nms", "axis0"], ["nms_boxes"]),
        n("Unsqueeze", ["all_scores", "axis0"], ["scores_1"]),
        n("Unsqueeze", ["scores_1", "axis0"], ["nms_scores"]),
        n("Constant", [], ["most"], value=numpy_helper.from_array(np.array([2 ** 63 - 1], np.int64))),
        n("Constant", [], ["iou"], value=numpy_helper.from_array(np.array([0.5], np.float32))),
        n("NonMaxSuppression", ["nms_boxes", "nms_scores", "most", "iou"], ["selected"]),
        n("Gather", ["selected", "two"], ["kept_col"], axis=1),
        n("Squeeze", ["kept_col", "axis1"], ["kept"]),
    ]
    some = helper.make_graph(batched, "some", [], [helper.make_tensor_value_info("kept", TensorProto.INT64, None)])
    nodes += [
        n("If", ["none_found"], ["kept_any"], then_branch=none, else_branch=some),
        n("Slice", ["kept_any", "start", "keep", "axis0", "axis1"], ["first"]),
        n("Gather", ["all_boxes", "first"], ["final_boxes"], axis=0),
        n("Gather", ["all_scores", "first"], ["scores_out"], axis=0),
        n("Gather", ["all_labels", "first"], ["labels_out"], axis=0),
        n("Split", ["final_boxes", "ones4"], ["x1", "y1", "x2", "y2"], axis=1),
    ]
    columns = []
    for name in ("x1", "y1", "x2", "y2"):
        nodes += [n("Squeeze", [name, "axis1"], [name + "_s"]), n("Mul", [name + "_s", "scale"], [name + "_m"]),
                  n("Unsqueeze", [name + "_m", "axis1"], [name + "_u"])]
        columns.append(name + "_u")
    nodes.append(n("Concat", columns, ["boxes_out"], axis=1))
    graph = helper.make_graph(
        nodes, "torchvision_postprocess",
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [boxes_n, classes]),
         helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [boxes_n, 4])],
        [helper.make_tensor_value_info("boxes_out", TensorProto.FLOAT, ["n", 4]),
         helper.make_tensor_value_info("scores_out", TensorProto.FLOAT, ["n"]),
         helper.make_tensor_value_info("labels_out", TensorProto.INT64, ["n"])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def postprocess_input(seed: int, boxes_n: int = 24, classes: int = 4, found: float = 0.5) -> dict:
    """Scores whose share above the threshold is about `found` (0: none),
    and boxes (x1, y1, x2, y2) on a small grid that overlap their neighbours."""
    rng = np.random.default_rng(seed)
    scores = rng.random((boxes_n, classes)).astype(np.float32) * 0.3
    scores[rng.random((boxes_n, classes)) < found] += 0.4
    corner = rng.random((boxes_n, 2)).astype(np.float32) * 4
    size = 0.5 + rng.random((boxes_n, 2)).astype(np.float32) * 2
    return {"scores": scores, "boxes": np.concatenate([corner, corner + size], axis=1)}

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

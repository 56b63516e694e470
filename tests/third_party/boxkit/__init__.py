"""boxkit: a stand-in for a third-party library such as torchvision.

Loading it defines ``torch.ops.boxkit.nms`` (CPU kernel in ``nms.cpp``) and
registers the operator's fake kernel, as torchvision does for its own ops, so
that torch.compile can trace calls without running them.
"""

from pathlib import Path

import torch

torch.ops.load_library(str(Path(__file__).with_name("_boxkit.so")))


@torch.library.register_fake("boxkit::nms")
def _nms_fake(boxes, scores, iou_threshold):
    # How many boxes survive depends on the data: an unbacked size.
    kept = torch.library.get_ctx().new_dynamic_size()
    return boxes.new_empty(kept, dtype=torch.long)


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Indices of the boxes non-maximum suppression keeps, highest score first."""
    return torch.ops.boxkit.nms(boxes, scores, iou_threshold)

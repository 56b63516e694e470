"""Chapter 15's kernel for a third-party operator, registered from Python.

Run after `import torch_acme` (the library itself may be imported before or
after). The same registration as csrc/aten/third_party_ops.cpp: a kernel for
boxkit::nms at PrivateUse1, written with torch operations on acme tensors, and
a fallthrough at the autograd key (nms returns indices).
"""

import torch

# Keep the Library alive: when it is garbage collected, the kernels are removed.
boxkit_lib = torch.library.Library("boxkit", "IMPL")


def nms(boxes, scores, iou_threshold):
    torch._check(boxes.device == scores.device, lambda: "boxkit::nms: boxes on "
                 f"{boxes.device} but scores on {scores.device}")
    x1, y1, x2, y2 = boxes.unbind(1)
    area = (x2 - x1) * (y2 - y1)
    w = (torch.minimum(x2[:, None], x2) - torch.maximum(x1[:, None], x1)).clamp_min(0)
    h = (torch.minimum(y2[:, None], y2) - torch.maximum(y1[:, None], y1)).clamp_min(0)
    overlap = w * h
    # Pairwise on the device; the greedy walk reads one boolean matrix on the host.
    suppresses = (overlap / (area[:, None] + area - overlap) > iou_threshold).cpu()
    order = scores.argsort(stable=True, descending=True).cpu()
    removed = torch.zeros(len(order), dtype=torch.bool)
    kept = []
    for i in order.tolist():
        if not removed[i]:
            kept.append(i)
            removed |= suppresses[i]
    return torch.tensor(kept, dtype=torch.long, device=boxes.device)


boxkit_lib.impl("nms", nms, "PrivateUse1")
boxkit_lib.impl("nms", torch.library.fallthrough_kernel, "AutogradPrivateUse1")

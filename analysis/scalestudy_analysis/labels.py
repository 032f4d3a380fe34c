"""Point labels that do not overlap: each label takes the first free spot around its point.

Points of a parity plot crowd (a quick-start's ZeRO stages run at nearly one speed), and labels at
one fixed offset print over each other. Placement is greedy in display space after the layout is
settled; a label with no free spot is left out (and counted), never drawn over another.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from matplotlib.axes import Axes
from matplotlib.transforms import Bbox

# Offsets (points) tried in order: right-above, right-below, left-above, left-below, farther out.
OFFSETS = ((4, 3), (4, -11), (-4, 3), (-4, -11), (8, 11), (-8, -19), (8, -19), (-8, 11),
           (12, 19), (-12, -27))
POINT_RADIUS_PX = 3.5


def place_labels(ax: Axes, xs: Iterable[float], ys: Iterable[float], texts: Iterable[str],
                 fontsize: float = 7) -> int:
    """Annotate (x, y) points with texts where each fits inside the axes without touching another
    label, a point or the legend; a text repeated at one spot is written once. Returns how many
    were left out. Extents are measured by the renderer, so they hold at any dpi (text and
    positions scale together)."""
    fig = ax.figure
    fig.draw_without_rendering()  # settle constrained layout: positions are final from here
    renderer = fig._get_renderer()
    frame = ax.get_window_extent(renderer)
    xs, ys, texts = list(xs), list(ys), list(texts)
    points = ax.transData.transform(np.column_stack([xs, ys]).astype(float))
    taken = [Bbox.from_extents(px - POINT_RADIUS_PX, py - POINT_RADIUS_PX, px + POINT_RADIUS_PX,
                               py + POINT_RADIUS_PX) for px, py in points]
    if ax.get_legend() is not None:
        taken.append(ax.get_legend().get_window_extent(renderer))
    seen, left_out = set(), 0
    for (px, py), text in sorted(zip(points.tolist(), texts), key=lambda p: (p[0][0], p[0][1])):
        key = (round(px), round(py), text)
        if key in seen:
            continue
        seen.add(key)
        xy = ax.transData.inverted().transform((px, py))
        for dx, dy in OFFSETS:
            label = ax.annotate(text, xy, textcoords="offset points", xytext=(dx, dy),
                                fontsize=fontsize, ha="right" if dx < 0 else "left", va="bottom")
            box = label.get_window_extent(renderer)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 \
                and box.y1 <= frame.y1
            if inside and not any(box.overlaps(t) for t in taken):
                taken.append(box)
                break
            label.remove()
        else:
            left_out += 1
    return left_out


__all__ = ["place_labels"]

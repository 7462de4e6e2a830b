"""What a reader sees of a figure: the text boxes that collide once it is laid out.

A figure whose titles, legend or tick labels run into each other cannot be read, whatever its numbers;
the check runs on matplotlib's own renderer, on the layout the saved image has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from matplotlib.axes import Axes
from matplotlib.axis import Axis
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.text import Text
from matplotlib.transforms import Bbox

# A pixel of contact is anti-aliasing, not a collision.
_TOLERANCE_PX = 1.0


@dataclass(frozen=True)
class Box:
    """One piece of text (or a whole legend) as drawn: what it is and where."""

    name: str
    bbox: Bbox


def _shown(text: Text) -> bool:
    return text.get_visible() and bool(text.get_text().strip())


def _tick_labels(axis: Axis) -> list[Text]:
    """The tick labels actually drawn: visible, non-empty, at a tick inside the view."""
    lo, hi = sorted(axis.get_view_interval())
    span = (hi - lo) * 1e-9
    out = []
    for tick in axis.get_major_ticks() + axis.get_minor_ticks():
        if not (lo - span <= tick.get_loc() <= hi + span):
            continue
        out += [t for t in (tick.label1, tick.label2) if _shown(t)]
    return out


def _axes_boxes(ax: Axes, renderer: Any, index: int) -> list[Box]:
    where = ax.get_title() or ax.get_ylabel() or f"axes {index}"
    boxes = []
    for loc in ("left", "center", "right"):
        title = ax.get_title(loc)
        if title.strip():
            artist = {"left": ax._left_title, "center": ax.title, "right": ax._right_title}[loc]
            if artist.get_visible():
                boxes.append(Box(f"title {title!r}", artist.get_window_extent(renderer)))
    for axis, label in ((ax.xaxis, "x"), (ax.yaxis, "y")):
        if _shown(axis.label):
            boxes.append(
                Box(f"{label}label {axis.label.get_text()!r} of {where!r}", axis.label.get_window_extent(renderer))
            )
        for t in _tick_labels(axis):
            boxes.append(Box(f"{label} tick {t.get_text()!r} of {where!r}", t.get_window_extent(renderer)))
    for child in ax.texts:
        if _shown(child):
            boxes.append(Box(f"text {child.get_text()!r} in {where!r}", child.get_window_extent(renderer)))
    return boxes


def text_boxes(fig: Figure, renderer: Any) -> list[Box]:
    """Every drawn text box of ``fig``: suptitle, figure texts and legends, each axes' titles, axis
    labels, tick labels and texts, and each legend as one box."""
    boxes: list[Box] = []
    if fig._suptitle is not None and _shown(fig._suptitle):
        boxes.append(Box(f"suptitle {fig._suptitle.get_text()!r}", fig._suptitle.get_window_extent(renderer)))
    for child in fig.texts:
        if child is not fig._suptitle and _shown(child):
            boxes.append(Box(f"figure text {child.get_text()!r}", child.get_window_extent(renderer)))
    legends: list[Legend] = list(fig.legends)
    for index, ax in enumerate(fig.axes):
        if not ax.get_visible():
            continue
        if ax.axison:
            boxes += _axes_boxes(ax, renderer, index)
        # a switched-off axes still shows its legend (a spare grid cell that holds the figure's legend)
        if ax.get_legend() is not None:
            legends.append(ax.get_legend())
    for i, leg in enumerate(legends):
        if leg.get_visible():
            boxes.append(Box(f"legend {i} ({', '.join(t.get_text() for t in leg.get_texts()[:3])} …)",
                             leg.get_window_extent(renderer)))  # fmt: skip
    return boxes


def _overlap(a: Bbox, b: Bbox) -> bool:
    width = min(a.x1, b.x1) - max(a.x0, b.x0)
    height = min(a.y1, b.y1) - max(a.y0, b.y0)
    return width > _TOLERANCE_PX and height > _TOLERANCE_PX


def overlaps(fig: Figure) -> list[str]:
    """The pairs of text boxes of ``fig`` that overlap once it is drawn, and every figure legend that
    covers an axes' plotting area; empty when the figure can be read."""
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    boxes = text_boxes(fig, renderer)
    found = []
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if _overlap(a.bbox, b.bbox):
                found.append(f"{a.name} overlaps {b.name}")
    for leg in fig.legends:
        box = leg.get_window_extent(renderer)
        for ax in fig.axes:
            if ax.get_visible() and ax.axison and _overlap(box, ax.get_window_extent(renderer)):
                found.append(f"a figure legend covers the axes {ax.get_title() or ax.get_ylabel()!r}")
    return found


class UnreadableFigure(ValueError):
    """A figure whose text collides: it is not saved."""


def check_readable(fig: Figure, name: str) -> None:
    """Raises :class:`UnreadableFigure` naming every collision in ``fig``."""
    found = overlaps(fig)
    if found:
        raise UnreadableFigure(f"figure {name!r}: " + "; ".join(found))

"""Small PNG charts without matplotlib: a pixel buffer, lines, points, axes with ticks, a 5x7 bitmap font.

`autopar report` draws two charts with it (autopar.tune.report.write_plots). It depends on nothing but
the standard library: the image is an RGB pixel buffer, written as a PNG (8-bit RGB, no interlace, filter
0 on every row) with zlib and struct. Text is upper case, drawn with a built-in 5x7 font (letters,
digits and a few signs; other characters draw as blanks). Each PNG also carries its axes' ranges in a
tEXt chunk ("autopar-axes": "x=LO..HI y=LO..HI"), so the numbers are there even where the labels are
too coarse to read.

    fig = scatter_with_diagonal([("measured", [(1.0, 1.2), (2.0, 1.9)], (31, 119, 180))], "out.png",
                                title="T", xlabel="PREDICTED", ylabel="MEASURED")
    fig.axes.to_pixel(1.0, 1.2)   # where that point's centre was drawn
    width, height, pixels = read_png(fig.path.read_bytes())
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

Color = tuple[int, int, int]
WHITE: Color = (255, 255, 255)
BLACK: Color = (0, 0, 0)
GREY: Color = (160, 160, 160)
LIGHT: Color = (232, 232, 232)
BLUE: Color = (31, 119, 180)
ORANGE: Color = (255, 127, 14)
GREEN: Color = (44, 160, 44)
RED: Color = (214, 39, 40)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# ---------------------------------------------------------------------------------------------------
# The 5x7 font: 7 rows of 5 columns per glyph ('#' on)
# ---------------------------------------------------------------------------------------------------
_GLYPHS_TEXT = {
    "A": ".###. #...# #...# ##### #...# #...# #...#",
    "B": "####. #...# #...# ####. #...# #...# ####.",
    "C": ".###. #...# #.... #.... #.... #...# .###.",
    "D": "###.. #..#. #...# #...# #...# #..#. ###..",
    "E": "##### #.... #.... ####. #.... #.... #####",
    "F": "##### #.... #.... ####. #.... #.... #....",
    "G": ".###. #...# #.... #.### #...# #...# .####",
    "H": "#...# #...# #...# ##### #...# #...# #...#",
    "I": ".###. ..#.. ..#.. ..#.. ..#.. ..#.. .###.",
    "J": "..### ...#. ...#. ...#. ...#. #..#. .##..",
    "K": "#...# #..#. #.#.. ##... #.#.. #..#. #...#",
    "L": "#.... #.... #.... #.... #.... #.... #####",
    "M": "#...# ##.## #.#.# #.#.# #...# #...# #...#",
    "N": "#...# #...# ##..# #.#.# #..## #...# #...#",
    "O": ".###. #...# #...# #...# #...# #...# .###.",
    "P": "####. #...# #...# ####. #.... #.... #....",
    "Q": ".###. #...# #...# #...# #.#.# #..#. .##.#",
    "R": "####. #...# #...# ####. #.#.. #..#. #...#",
    "S": ".#### #.... #.... .###. ....# ....# ####.",
    "T": "##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#..",
    "U": "#...# #...# #...# #...# #...# #...# .###.",
    "V": "#...# #...# #...# #...# #...# .#.#. ..#..",
    "W": "#...# #...# #...# #.#.# #.#.# #.#.# .#.#.",
    "X": "#...# #...# .#.#. ..#.. .#.#. #...# #...#",
    "Y": "#...# #...# .#.#. ..#.. ..#.. ..#.. ..#..",
    "Z": "##### ....# ...#. ..#.. .#... #.... #####",
    "0": ".###. #...# #..## #.#.# ##..# #...# .###.",
    "1": "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.",
    "2": ".###. #...# ....# ...#. ..#.. .#... #####",
    "3": "##### ...#. ..#.. ...#. ....# #...# .###.",
    "4": "...#. ..##. .#.#. #..#. ##### ...#. ...#.",
    "5": "##### #.... ####. ....# ....# #...# .###.",
    "6": "..##. .#... #.... ####. #...# #...# .###.",
    "7": "##### ....# ...#. ..#.. .#... .#... .#...",
    "8": ".###. #...# #...# .###. #...# #...# .###.",
    "9": ".###. #...# #...# .#### ....# ...#. .##..",
    ".": "..... ..... ..... ..... ..... .##.. .##..",
    ",": "..... ..... ..... ..... .##.. ..#.. .#...",
    "-": "..... ..... ..... ##### ..... ..... .....",
    "+": "..... ..#.. ..#.. ##### ..#.. ..#.. .....",
    "/": "..... ....# ...#. ..#.. .#... #.... .....",
    "%": "##... ##..# ...#. ..#.. .#... #..## ...##",
    ":": "..... .##.. .##.. ..... .##.. .##.. .....",
    "=": "..... ..... ##### ..... ##### ..... .....",
    "(": "...#. ..#.. .#... .#... .#... ..#.. ...#.",
    ")": ".#... ..#.. ...#. ...#. ...#. ..#.. .#...",
    " ": "..... ..... ..... ..... ..... ..... .....",
}
GLYPHS: dict[str, tuple[str, ...]] = {c: tuple(rows.split()) for c, rows in _GLYPHS_TEXT.items()}
GLYPH_W, GLYPH_H = 5, 7


def text_width(text: str, scale: int = 1) -> int:
    return max(0, len(text) * (GLYPH_W + 1) - 1) * scale


# ---------------------------------------------------------------------------------------------------
# The canvas and the PNG
# ---------------------------------------------------------------------------------------------------
class Canvas:
    """An RGB image, origin at the top left; drawing outside it is clipped."""

    def __init__(self, width: int, height: int, background: Color = WHITE) -> None:
        if width < 1 or height < 1:
            raise ValueError(f"a canvas needs a positive size, got {width} x {height}.")
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def get(self, x: int, y: int) -> Color:
        i = 3 * (y * self.width + x)
        return (self.pixels[i], self.pixels[i + 1], self.pixels[i + 2])

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i:i + 3] = bytes(color)

    def fill_rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        for y in range(max(0, min(y0, y1)), min(self.height, max(y0, y1) + 1)):
            for x in range(max(0, min(x0, x1)), min(self.width, max(x0, x1) + 1)):
                self.set(x, y, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, width: int = 1) -> None:
        """Bresenham's line, `width` pixels thick (a square brush)."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        half = (width - 1) // 2
        while True:
            if width == 1:
                self.set(x0, y0, color)
            else:
                self.fill_rect(x0 - half, y0 - half, x0 - half + width - 1, y0 - half + width - 1, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def disc(self, cx: int, cy: int, r: int, color: Color) -> None:
        for y in range(cy - r, cy + r + 1):
            for x in range(cx - r, cx + r + 1):
                if (x - cx) ** 2 + (y - cy) ** 2 <= r * r + r:
                    self.set(x, y, color)

    def text(self, x: int, y: int, text: str, color: Color = BLACK, *, scale: int = 1, vertical: bool = False) -> None:
        """Draw `text` (upper-cased) with its top-left corner at (x, y); `vertical` reads bottom to top, with
        (x, y) the bottom-left corner."""
        for n, ch in enumerate(text.upper()):
            glyph = GLYPHS.get(ch, GLYPHS[" "])
            for gy, row in enumerate(glyph):
                for gx, bit in enumerate(row):
                    if bit != "#":
                        continue
                    for a in range(scale):
                        for b in range(scale):
                            if vertical:
                                px = x + gy * scale + b
                                py = y - (n * (GLYPH_W + 1) + gx) * scale - a
                            else:
                                px = x + (n * (GLYPH_W + 1) + gx) * scale + a
                                py = y + gy * scale + b
                            self.set(px, py, color)

    def to_png(self, text: dict[str, str] | None = None) -> bytes:
        return encode_png(self.width, self.height, bytes(self.pixels), text=text)

    def save(self, path: str | Path, text: dict[str, str] | None = None) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.to_png(text))
        return path


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(width: int, height: int, rgb: bytes, *, text: dict[str, str] | None = None) -> bytes:
    """A PNG of 8-bit RGB pixels (`rgb`: rows top to bottom, 3 bytes a pixel), each row with filter 0."""
    if len(rgb) != width * height * 3:
        raise ValueError(f"{width} x {height} RGB pixels are {width * height * 3} bytes, got {len(rgb)}.")
    stride = width * 3
    raw = b"".join(b"\x00" + rgb[y * stride:(y + 1) * stride] for y in range(height))
    out = [PNG_SIGNATURE, _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))]
    for key, value in (text or {}).items():
        out.append(_chunk(b"tEXt", key.encode("latin-1")[:79] + b"\x00" + value.encode("latin-1", "replace")))
    out.append(_chunk(b"IDAT", zlib.compress(raw, 9)))
    out.append(_chunk(b"IEND", b""))
    return b"".join(out)


def read_png(data: bytes) -> tuple[int, int, list[list[Color]], dict[str, str]]:
    """Read back a PNG this module wrote (8-bit RGB, filter 0): width, height, pixel rows, tEXt chunks.
    Checks the signature, every chunk's CRC and the decompressed size; raises ValueError otherwise."""
    if data[:8] != PNG_SIGNATURE:
        raise ValueError("not a PNG: the signature is wrong.")
    pos, idat, text = 8, b"", {}
    width = height = None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        if zlib.crc32(kind + body) & 0xFFFFFFFF != crc:
            raise ValueError(f"chunk {kind!r} has a wrong CRC.")
        if kind == b"IHDR":
            width, height, depth, color, comp, filt, interlace = struct.unpack(">IIBBBBB", body)
            if (depth, color, comp, filt, interlace) != (8, 2, 0, 0, 0):
                raise ValueError("only 8-bit RGB, non-interlaced PNGs are read here.")
        elif kind == b"IDAT":
            idat += body
        elif kind == b"tEXt":
            k, _, v = body.partition(b"\x00")
            text[k.decode("latin-1")] = v.decode("latin-1")
        elif kind == b"IEND":
            break
        pos += 12 + length
    if width is None or height is None:
        raise ValueError("no IHDR chunk.")
    raw = zlib.decompress(idat)
    stride = 1 + 3 * width
    if len(raw) != stride * height:
        raise ValueError(f"the image data is {len(raw)} bytes, not {height} rows of {stride}.")
    rows = []
    for y in range(height):
        line = raw[y * stride:(y + 1) * stride]
        if line[0] != 0:
            raise ValueError(f"row {y} uses filter {line[0]}; only filter 0 is read here.")
        rows.append([tuple(line[1 + 3 * x:4 + 3 * x]) for x in range(width)])
    return width, height, rows, text


# ---------------------------------------------------------------------------------------------------
# Axes
# ---------------------------------------------------------------------------------------------------
def nice_step(span: float, n: int = 5) -> float:
    """A tick step of 1, 2 or 5 x 10^k giving about `n` ticks over `span`."""
    if span <= 0 or not math.isfinite(span):
        return 1.0
    raw = span / max(n - 1, 1)
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def value_range(values: Iterable[float], *, pad: float = 0.06, zero: bool = False) -> tuple[float, float]:
    """A range holding every value with a margin; (0, 1) when there are none; from 0 with `zero`."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return 0.0, 1.0
    lo, hi = min(vals), max(vals)
    if zero:
        lo = min(lo, 0.0)
    if hi == lo:
        d = abs(hi) * 0.1 or 1.0
        return lo - d, hi + d
    d = (hi - lo) * pad
    return (lo if zero and lo == 0 else lo - d), hi + d


def compact(value: float) -> str:
    """A short tick label: 950, 1.2K, 35K, 1.5M, 0.25."""
    a = abs(value)
    for div, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if a >= div:
            s = f"{value / div:.3g}"
            return s + unit
    if a == 0:
        return "0"
    return f"{value:.3g}"


@dataclass(frozen=True)
class Axes:
    """A data rectangle mapped onto the pixel rectangle (left, top)-(right, bottom)."""

    left: int
    top: int
    right: int
    bottom: int
    xmin: float
    xmax: float
    ymin: float
    ymax: float

    def to_pixel(self, x: float, y: float) -> tuple[int, int]:
        px = self.left + (x - self.xmin) / (self.xmax - self.xmin) * (self.right - self.left)
        py = self.bottom - (y - self.ymin) / (self.ymax - self.ymin) * (self.bottom - self.top)
        return int(round(px)), int(round(py))

    def draw(self, canvas: Canvas, *, xlabel: str = "", ylabel: str = "", title: str = "",
             integer_x: bool = False) -> None:
        """Grid, frame, tick marks and labels, axis labels and the title."""
        xs = _ticks(self.xmin, self.xmax, integer=integer_x)
        ys = _ticks(self.ymin, self.ymax)
        for x in xs:
            px, _ = self.to_pixel(x, self.ymin)
            canvas.line(px, self.top, px, self.bottom, LIGHT)
        for y in ys:
            _, py = self.to_pixel(self.xmin, y)
            canvas.line(self.left, py, self.right, py, LIGHT)
        canvas.line(self.left, self.bottom, self.right, self.bottom, BLACK)
        canvas.line(self.left, self.top, self.left, self.bottom, BLACK)
        canvas.line(self.right, self.top, self.right, self.bottom, GREY)
        canvas.line(self.left, self.top, self.right, self.top, GREY)
        for x in xs:
            px, _ = self.to_pixel(x, self.ymin)
            canvas.line(px, self.bottom, px, self.bottom + 5, BLACK)
            label = compact(x)
            canvas.text(px - text_width(label) // 2, self.bottom + 8, label)
        for y in ys:
            _, py = self.to_pixel(self.xmin, y)
            canvas.line(self.left - 5, py, self.left, py, BLACK)
            label = compact(y)
            canvas.text(self.left - 8 - text_width(label), py - GLYPH_H // 2, label)
        if xlabel:
            canvas.text((self.left + self.right - text_width(xlabel)) // 2, self.bottom + 24, xlabel)
        if ylabel:
            canvas.text(8, (self.top + self.bottom + text_width(ylabel)) // 2, ylabel, vertical=True)
        if title:
            canvas.text((canvas.width - text_width(title, 2)) // 2, 10, title, scale=2)

    def describe(self) -> str:
        return f"x={self.xmin:.6g}..{self.xmax:.6g} y={self.ymin:.6g}..{self.ymax:.6g}"


def _ticks(lo: float, hi: float, *, integer: bool = False) -> list[float]:
    step = nice_step(hi - lo)
    if integer:
        step = max(1.0, round(step))
    first = math.ceil(lo / step - 1e-9) * step
    out, v = [], first
    while v <= hi + 1e-9 * abs(step) and len(out) < 50:
        out.append(0.0 if abs(v) < step * 1e-9 else v)
        v += step
    return out


@dataclass(frozen=True)
class Figure:
    """A chart written to `path`, with the axes that map data to its pixels."""

    path: Path
    axes: Axes
    width: int
    height: int


def _frame(width: int, height: int, xr: tuple[float, float], yr: tuple[float, float]) -> tuple[Canvas, Axes]:
    canvas = Canvas(width, height)
    axes = Axes(left=78, top=52, right=width - 20, bottom=height - 48, xmin=xr[0], xmax=xr[1], ymin=yr[0], ymax=yr[1])
    return canvas, axes


def _legend(canvas: Canvas, axes: Axes, entries: Sequence[tuple[str, Color]]) -> None:
    """One row of colour keys between the title and the plot, centred."""
    widths = [10 + text_width(label) + 14 for label, _ in entries]
    x = max(0, (canvas.width - sum(widths)) // 2)
    y = axes.top - 14
    for (label, color), w in zip(entries, widths):
        canvas.fill_rect(x, y, x + 6, y + 6, color)
        canvas.text(x + 10, y, label)
        x += w


def scatter_with_diagonal(series: Sequence[tuple[str, Sequence[tuple[float, float]], Color]], path: str | Path, *,
                          title: str = "", xlabel: str = "", ylabel: str = "", size: tuple[int, int] = (640, 480),
                          radius: int = 3) -> Figure:
    """Points of each series (label, [(x, y)], color) on equal x and y ranges, with the line y = x in grey."""
    values = [v for _, pts, _ in series for p in pts for v in p]
    lo, hi = value_range(values, zero=True)
    canvas, axes = _frame(size[0], size[1], (lo, hi), (lo, hi))
    axes.draw(canvas, xlabel=xlabel, ylabel=ylabel, title=title)
    canvas.line(*axes.to_pixel(lo, lo), *axes.to_pixel(hi, hi), GREY, width=1)
    for _, pts, color in series:
        for x, y in pts:
            canvas.disc(*axes.to_pixel(x, y), radius, color)
    _legend(canvas, axes, [(label, color) for label, pts, color in series if pts] + [("Y = X", GREY)])
    out = canvas.save(path, text={"autopar-axes": axes.describe(), "Title": title or "autopar chart"})
    return Figure(out, axes, *size)


def line_and_points(points: Sequence[tuple[float, float]], line: Sequence[tuple[float, float]], path: str | Path, *,
                    marks: Sequence[float] = (), title: str = "", xlabel: str = "", ylabel: str = "",
                    size: tuple[int, int] = (640, 480), radius: int = 3) -> Figure:
    """Points (blue), a step line through `line`'s points (green: a best-so-far), and red marks on the x axis at
    `marks` (trials that failed)."""
    xs = [x for x, _ in points] + [x for x, _ in line] + list(marks)
    ys = [y for _, y in points] + [y for _, y in line]
    xr = value_range(xs, pad=0.05)
    if xr[1] - xr[0] < 2:
        xr = (xr[0] - 1, xr[1] + 1)
    canvas, axes = _frame(size[0], size[1], xr, value_range(ys, zero=True))
    axes.draw(canvas, xlabel=xlabel, ylabel=ylabel, title=title, integer_x=True)
    for (x0, y0), (x1, y1) in zip(line, line[1:]):  # a step: across at the old best, then up
        a, b = axes.to_pixel(x0, y0), axes.to_pixel(x1, y0)
        canvas.line(*a, *b, GREEN, width=2)
        canvas.line(*b, *axes.to_pixel(x1, y1), GREEN, width=2)
    for x in marks:
        px, py = axes.to_pixel(x, axes.ymin)
        canvas.line(px - 4, py - 4, px + 4, py + 4, RED, width=2)
        canvas.line(px - 4, py + 4, px + 4, py - 4, RED, width=2)
    for x, y in points:
        canvas.disc(*axes.to_pixel(x, y), radius, BLUE)
    entries = [("MEASURED", BLUE), ("BEST SO FAR", GREEN)] + ([("FAILED", RED)] if marks else [])
    _legend(canvas, axes, entries)
    out = canvas.save(path, text={"autopar-axes": axes.describe(), "Title": title or "autopar chart"})
    return Figure(out, axes, *size)

"""The dependency-free PNG charts (autopar/tune/plots.py): valid files, and points where they belong."""

from __future__ import annotations

import struct
import zlib

import pytest

from autopar.tune import plots
from autopar.tune.plots import (BLUE, GREEN, GREY, ORANGE, RED, WHITE, Canvas, compact, encode_png, line_and_points,
                                  nice_step, read_png, scatter_with_diagonal)


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """Every chunk of a PNG, read independently of plots.read_png."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    out, pos = [], 8
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert zlib.crc32(kind + body) & 0xFFFFFFFF == crc
        out.append((kind, body))
        pos += 12 + n
    return out


def test_png_is_valid():
    c = Canvas(7, 5)
    c.set(2, 3, (10, 20, 30))
    data = c.to_png({"autopar-axes": "x=0..1 y=0..1"})
    chunks = _chunks(data)
    assert [k for k, _ in chunks][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    width, height, depth, color, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (width, height, depth, color, comp, filt, interlace) == (7, 5, 8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(b for k, b in chunks if k == b"IDAT"))
    assert len(raw) == height * (1 + 3 * width)  # a filter byte and RGB per row
    assert all(raw[y * (1 + 3 * width)] == 0 for y in range(height))
    row = raw[3 * (1 + 3 * width):4 * (1 + 3 * width)]
    assert row[1 + 3 * 2:4 + 3 * 2] == bytes((10, 20, 30)) and row[1:4] == bytes(WHITE)
    assert (b"tEXt", b"autopar-axes\x00x=0..1 y=0..1") in chunks
    w, h, pixels, text = read_png(data)
    assert (w, h) == (7, 5) and pixels[3][2] == (10, 20, 30) and text["autopar-axes"] == "x=0..1 y=0..1"


def test_read_png_refuses_damage():
    data = bytearray(Canvas(4, 4).to_png())
    with pytest.raises(ValueError, match="signature"):
        read_png(b"GIF89a" + bytes(data[6:]))
    data[-20] ^= 0xFF  # inside the IDAT chunk
    with pytest.raises(ValueError, match="CRC"):
        read_png(bytes(data))
    with pytest.raises(ValueError, match="bytes"):
        encode_png(2, 2, b"\x00" * 11)


def test_lines_discs_and_text_land_on_their_pixels():
    c = Canvas(40, 30)
    c.line(0, 0, 39, 29, RED)
    assert c.get(0, 0) == RED and c.get(39, 29) == RED
    c.line(5, 20, 30, 20, BLUE, width=3)
    assert c.get(5, 19) == BLUE and c.get(30, 21) == BLUE and c.get(17, 20) == BLUE
    c.disc(10, 10, 2, GREEN)
    assert c.get(10, 10) == GREEN and c.get(12, 10) == GREEN and c.get(13, 10) != GREEN
    c.line(-10, 5, 100, 5, GREY)  # clipped, no error
    blank = Canvas(20, 10)
    blank.text(1, 1, "1")  # the glyph of 1: its stem is column 2, rows 0-6
    assert blank.get(3, 1) == (0, 0, 0) and blank.get(3, 7) == (0, 0, 0) and blank.get(1, 1) == WHITE


def test_scatter_points_land_where_expected(tmp_path):
    before = [(100.0, 150.0), (400.0, 300.0)]
    after = [(160.0, 150.0), (290.0, 300.0)]
    fig = scatter_with_diagonal([("before", before, BLUE), ("after", after, ORANGE)], tmp_path / "t.png",
                                title="MEASURED VS PREDICTED", xlabel="PREDICTED", ylabel="MEASURED")
    width, height, pixels, text = read_png(fig.path.read_bytes())
    assert (width, height) == (640, 480)
    ax = fig.axes
    assert ax.xmin == ax.ymin == 0 and ax.xmax == ax.ymax >= 400  # the same range on both axes, from 0
    for pts, color in ((before, BLUE), (after, ORANGE)):
        for x, y in pts:
            px, py = ax.to_pixel(x, y)
            assert pixels[py][px] == color
            assert ax.left < px < ax.right and ax.top < py < ax.bottom
    # the y = x line goes through the data rectangle's corners
    for v in (0.0, ax.xmax * 0.5):
        px, py = ax.to_pixel(v, v)
        assert pixels[py][px] in (GREY, (0, 0, 0))
    # larger values to the right and up
    assert ax.to_pixel(400, 300)[0] > ax.to_pixel(100, 150)[0] and ax.to_pixel(400, 300)[1] < ax.to_pixel(100, 150)[1]
    assert text["autopar-axes"] == ax.describe() and text["autopar-axes"].startswith("x=0..")


def test_history_chart(tmp_path):
    points = [(0.0, 1000.0), (1.0, 800.0), (3.0, 1500.0), (4.0, 1200.0)]
    best = [(0.0, 1000.0), (1.0, 1000.0), (2.0, 1000.0), (3.0, 1500.0), (4.0, 1500.0)]
    fig = line_and_points(points, best, tmp_path / "h.png", marks=[2.0], title="HISTORY", xlabel="TRIAL",
                          ylabel="TOKENS/S")
    _, _, pixels, _ = read_png(fig.path.read_bytes())
    ax = fig.axes
    for x, y in points:
        px, py = ax.to_pixel(x, y)
        assert pixels[py][px] == BLUE
    px, py = ax.to_pixel(1.5, 1000.0)  # the best-so-far step, between two points
    assert pixels[py][px] == GREEN
    px, py = ax.to_pixel(2.0, ax.ymin)  # the failed trial's cross on the x axis
    assert pixels[py - 3][px - 3] == RED


def test_ticks_and_labels():
    assert nice_step(10) == 5 and nice_step(1) == 0.5 and nice_step(2400) == 1000
    assert compact(0) == "0" and compact(1500) == "1.5K" and compact(2_000_000) == "2M" and compact(0.25) == "0.25"
    assert plots.value_range([]) == (0.0, 1.0) and plots.value_range([5.0])[0] < 5 < plots.value_range([5.0])[1]
    assert set(plots.GLYPHS) >= set("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-+/%:=() ")
    assert all(len(g) == 7 and all(len(r) == 5 for r in g) for g in plots.GLYPHS.values())

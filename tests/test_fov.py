"""Field-of-view estimate: known answers on synthetic apertures, no false alarm on ordinary photos."""

import cv2
import numpy as np
import pytest

from wsseg.tasks.highres.fov import estimate_fov, fov_or_all, has_dark_border

from conftest import SAMPLE


def _aperture(h=300, w=450, radius=None, cy=None, cx=None, seed=0):
    """A textured reddish disc (cut at the top and bottom when larger than the image) on black, JPEG noise."""
    rng = np.random.default_rng(seed)
    radius = radius or 0.6 * w / 2 * 1.1
    cy, cx = cy or h / 2, cx or w / 2
    yy, xx = np.mgrid[:h, :w]
    disc = (yy - cy) ** 2 + (xx - cx) ** 2 <= radius ** 2
    image = np.zeros((h, w, 3), np.uint8)
    texture = cv2.GaussianBlur(rng.normal(0, 25, (h, w)).astype(np.float32), (7, 7), 2)
    image[..., 0] = np.clip(150 + texture, 0, 255)
    image[..., 1] = np.clip(60 + texture / 2, 0, 255)
    image[..., 2] = np.clip(30 + texture / 4, 0, 255)
    # dark lesions and vessels inside: holes to fill
    r = radius / 2
    cv2.circle(image, (int(cx + r / 4), int(cy)), int(r / 6), (15, 5, 2), -1)
    cv2.line(image, (int(cx - 0.8 * r), int(cy - 0.6 * r)), (int(cx + 0.6 * r), int(cy + 0.5 * r)), (20, 8, 4), 3)
    image[~disc] = 0
    noise = rng.integers(0, 12, (h, w, 3)).astype(np.uint8)
    image[~disc] += noise[~disc]
    ok, buf = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 90])
    return cv2.imdecode(buf, cv2.IMREAD_COLOR), disc


def _band_error(estimate, truth, tolerance):
    """Pixels where estimate and truth disagree farther than ``tolerance`` pixels from truth's edge."""
    t = truth.astype(np.uint8)
    inner = cv2.distanceTransform(t, cv2.DIST_L2, 5)
    outer = cv2.distanceTransform(1 - t, cv2.DIST_L2, 5)
    far = np.maximum(inner, outer) > tolerance
    return int(((estimate != truth) & far).sum())


@pytest.mark.parametrize("shape,radius", [((300, 450), 150), ((240, 400), 195), ((200, 200), 90)])
def test_disc_on_black_is_found_within_two_pixels(shape, radius):
    image, disc = _aperture(*shape, radius=radius)
    fov = estimate_fov(image)
    assert fov.shape == disc.shape and fov.dtype == bool
    assert _band_error(fov, disc, 2.0) == 0
    assert (fov & disc).sum() / (fov | disc).sum() > 0.98
    found, ok = fov_or_all(image)
    assert ok and np.array_equal(found, fov) and has_dark_border(image)


def test_shrunk_estimate_and_erosion():
    image, disc = _aperture(600, 900, radius=420)       # cut at top and bottom, like HRF
    fov = estimate_fov(image, max_side=256)             # estimated on a 256-pixel image, resized back
    assert _band_error(fov, disc, 4.0) == 0
    eroded = estimate_fov(image, erode=10)
    assert eroded.sum() < fov.sum() and not (eroded & ~fov).any()
    inner = cv2.distanceTransform(disc.astype(np.uint8), cv2.DIST_L2, 5)
    assert eroded[inner > 12].all() and not eroded[inner < 8].any()


def test_ordinary_photos_keep_every_pixel():
    """The 64 bundled MSRC-21 photos have no dark surround: nothing is masked."""
    paths = sorted((SAMPLE / "images").glob("*.jpg"))
    assert len(paths) == 64
    for path in paths:
        image = cv2.imread(str(path))[..., ::-1].copy()
        fov, found = fov_or_all(image)
        assert not found, path.name
        assert fov.all() and fov.shape == image.shape[:2]


def test_dark_object_on_bright_ground_is_no_aperture():
    # a bright frame with a dark square inside: the largest bright region is the frame, its
    # corners are bright -> no dark surround
    image = np.full((100, 140, 3), 200, np.uint8)
    image[30:70, 40:100] = 10
    assert not has_dark_border(image)
    # a bright square on black: corners dark but a square aperture is still convex -> found;
    # a ragged bright blob (a cross) is not
    square = np.zeros((100, 140, 3), np.uint8)
    square[20:80, 30:110] = 180
    assert has_dark_border(square)
    cross = np.zeros((100, 140, 3), np.uint8)
    cross[45:55, 10:130] = 180
    cross[10:90, 65:75] = 180
    assert not has_dark_border(cross)


def test_all_dark_image_and_bad_input():
    black = np.zeros((40, 50, 3), np.uint8)
    assert not estimate_fov(black).any()
    fov, found = fov_or_all(black)
    assert not found and fov.all()
    with pytest.raises(ValueError, match="uint8 RGB"):
        estimate_fov(np.zeros((40, 50), np.uint8))
    with pytest.raises(ValueError, match="max_side"):
        estimate_fov(black, max_side=8)

"""A small ImageNet-like folder made from real photographs, for examples, tests and benchmarks.

The photographs are scikit-image's sample images (public domain / CC0, see photos/README.md),
shipped with the package so this works offline. Each class is one region of one photograph;
each image is a jittered crop of that region, rescaled to an ImageNet-like size (500x375,
375x500, 500x333, ...), lightly colour-jittered, with fine sensor grain, and re-encoded as a
JPEG of ImageNet's typical ~110 KB. Classes are learnable (a ResNet separates them within a
few epochs), so accuracy in the examples means something.

Like ImageNet's train set the folder holds a few awkward files: a grayscale JPEG, a CMYK JPEG,
a PNG named .JPEG, a progressive JPEG and one large (4000x3000) photo.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .. import fileio

__all__ = ["make_image_folder", "PHOTOS"]

PHOTOS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "photos")
PHOTOS = sorted(f for f in os.listdir(PHOTOS_DIR) if f.endswith(".jpg")) if os.path.isdir(PHOTOS_DIR) else []
SIZES = [(500, 375), (375, 500), (500, 333), (333, 500), (500, 400), (400, 500)]
EDGE_CASES = ("gray", "cmyk", "png", "progressive", "large")
STAMP = ".done"
_FORMAT = 2  # bump when the rendering changes, so folders written by older code are regenerated
_OURS = {"train", "val", STAMP}  # all a folder of ours holds: anything else is not ours to replace


def _class_views(classes: int, seed: int):
    """(photo, center_x, center_y, side) of every class, in fractions of the photo."""
    rng = np.random.default_rng(seed)
    views = []
    for c in range(classes):
        photo = PHOTOS[c % len(PHOTOS)]
        views.append((photo, rng.uniform(0.3, 0.7), rng.uniform(0.3, 0.7), rng.uniform(0.35, 0.6)))
    return views


def _render(photo, view, rng: np.random.Generator, size, quality: int, kind: str | None, path: str) -> int:
    from PIL import Image, ImageEnhance

    _, cx, cy, side = view
    w_px, h_px = photo.size
    base = min(w_px, h_px) * side * rng.uniform(0.85, 1.15)
    out_w, out_h = size
    aspect = out_w / out_h
    crop_w, crop_h = base * np.sqrt(aspect), base / np.sqrt(aspect)
    x = np.clip(cx * w_px + rng.normal(0, 0.04) * w_px - crop_w / 2, 0, max(0, w_px - crop_w))
    y = np.clip(cy * h_px + rng.normal(0, 0.04) * h_px - crop_h / 2, 0, max(0, h_px - crop_h))
    image = photo.convert("RGB").resize(
        (out_w, out_h), Image.BICUBIC, box=(x, y, min(w_px, x + crop_w), min(h_px, y + crop_h))
    )
    image = ImageEnhance.Color(image).enhance(rng.uniform(0.8, 1.2))
    image = ImageEnhance.Brightness(image).enhance(rng.uniform(0.85, 1.15))
    pixels = np.asarray(image, dtype=np.float32)
    pixels += rng.normal(0.0, 8.0, size=pixels.shape).astype(np.float32)  # sensor grain
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    if kind == "gray":
        image = image.convert("L")
    elif kind == "cmyk":
        image = image.convert("CMYK")
    if kind == "png":
        image.save(path, format="PNG")
    else:
        image.save(path, format="JPEG", quality=quality, progressive=kind == "progressive")
    return os.path.getsize(path)


def make_image_folder(
    root: str,
    classes: int = 100,
    train_per_class: int = 40,
    val_per_class: int = 10,
    *,
    quality: int = 95,
    edge_cases=True,
    seed: int = 0,
    threads: int | None = None,
    progress: bool = True,
) -> tuple[str, str]:
    """Write ``root/train/<class>/*.JPEG`` and ``root/val/<class>/*.JPEG``; returns both paths.

    edge_cases: True for all of ``EDGE_CASES`` (one file each, in the first classes), or a
    subset of their names, or False.
    The images are written into a staging folder beside ``root`` and renamed into place when
    complete, so ``root/.done`` (the arguments) always describes what the folder holds. A complete
    folder with the same arguments is reused; any other earlier sample folder is replaced whole.
    A folder holding anything else raises FileExistsError rather than being deleted."""
    if not PHOTOS:
        raise FileNotFoundError(f"the sample photographs are missing from {PHOTOS_DIR}")
    if classes < 1 or train_per_class < 1 or val_per_class < 0:
        raise ValueError(f"need classes >= 1 and train_per_class >= 1, got {classes}, {train_per_class}")
    edge = EDGE_CASES if edge_cases is True else tuple(edge_cases or ())
    unknown = set(edge) - set(EDGE_CASES)
    if unknown:
        raise ValueError(f"unknown edge cases {sorted(unknown)}; known: {EDGE_CASES}")
    root = os.path.abspath(root)
    stamp = f"v{_FORMAT} {classes} {train_per_class} {val_per_class} {quality} {list(edge)} {seed}\n"
    train, val = os.path.join(root, "train"), os.path.join(root, "val")
    if _is_complete(root, stamp, classes, train_per_class, val_per_class):
        return train, val
    _check_replaceable(root)
    parent = os.path.dirname(root)
    os.makedirs(parent, exist_ok=True)
    _remove_abandoned(parent, os.path.basename(root))
    staging = tempfile.mkdtemp(prefix=_staging_prefix(root) + f"{os.getpid()}-", dir=parent)
    try:
        _generate(staging, classes, train_per_class, val_per_class, quality, edge, seed, threads, progress, root)
        with open(os.path.join(staging, STAMP), "w") as f:
            f.write(stamp)
        try:
            _swap_into_place(staging, root)
        except OSError:
            # another process (a node of the same job) renamed its identical set into place first
            if not _is_complete(root, stamp, classes, train_per_class, val_per_class):
                raise
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return train, val


def _staging_prefix(root: str) -> str:
    return f".{os.path.basename(root)}.partial-"


def _is_complete(root: str, stamp: str, classes: int, train_per_class: int, val_per_class: int) -> bool:
    """The stamp matches and the folder holds exactly the classes and files it describes."""
    try:
        with open(os.path.join(root, STAMP)) as f:
            if f.read() != stamp:
                return False
    except OSError:
        return False
    for split, per_class in (("train", train_per_class), ("val", val_per_class)):
        folder = os.path.join(root, split)
        try:
            names = sorted(os.listdir(folder))
            if names != [f"n{c:08d}" for c in range(classes)]:
                return False
            if any(len(os.listdir(os.path.join(folder, name))) != per_class for name in names):
                return False
        except OSError:
            return False
    return True


def _check_replaceable(root: str) -> None:
    """Refuse to replace a folder that holds anything but an earlier sample set."""
    if not os.path.exists(root):
        return
    if not os.path.isdir(root):
        raise FileExistsError(f"{root} exists and is not a folder; pass another sample folder")
    foreign = set(os.listdir(root)) - _OURS
    if foreign:
        raise FileExistsError(
            f"{root} holds {sorted(foreign)[:5]}, which a sample folder never does: refusing to replace it "
            "with the generated images; pass an empty or new folder"
        )


def _remove_abandoned(parent: str, name: str) -> None:
    """Staging folders of generators that died (killed mid-run) are deleted."""
    prefix = f".{name}.partial-"
    for entry in os.listdir(parent):
        if not entry.startswith(prefix):
            continue
        pid = entry[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not fileio.process_alive(int(pid)):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _swap_into_place(staging: str, root: str) -> None:
    """Rename the finished folder to ``root``; an earlier folder there is moved aside, then removed."""
    if os.path.exists(root):
        fileio.replace_dir(staging, root, aside_prefix=_staging_prefix(root) + f"{os.getpid()}-old-")
    else:
        os.rename(staging, root)  # raises where another process put its set there meanwhile


def _generate(
    out: str, classes, train_per_class, val_per_class, quality, edge, seed, threads, progress, shown_as: str
) -> None:
    """Render every image under ``out`` (a staging folder)."""
    from PIL import Image

    photos = {name: Image.open(os.path.join(PHOTOS_DIR, name)) for name in PHOTOS}
    for image in photos.values():
        image.load()
    views = _class_views(classes, seed)
    jobs = []
    for split, per_class in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = os.path.join(out, split, f"n{c:08d}")
            os.makedirs(folder, exist_ok=True)
            for k in range(per_class):
                kind = None
                if split == "train" and k == 0 and c < len(edge):
                    kind = edge[c]
                elif split == "val" and k == 0 and c < min(2, len(edge)):
                    kind = edge[c]
                jobs.append((split, c, k, kind, os.path.join(folder, f"n{c:08d}_{k}.JPEG")))

    def run(job):
        split, c, k, kind, path = job
        rng = np.random.default_rng([seed, c, k, split == "val"])
        size = (4000, 3000) if kind == "large" else SIZES[int(rng.integers(len(SIZES)))]
        return _render(photos[views[c][0]], views[c], rng, size, quality, kind, path)

    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(jobs), desc=f"generating {shown_as}", unit="img", file=sys.stderr, mininterval=0.5)
        except ImportError:
            pass
    total = 0
    with ThreadPoolExecutor(threads or min(16, os.cpu_count() or 1)) as pool:  # PIL releases the GIL
        for nbytes in pool.map(run, jobs):
            total += nbytes
            if bar is not None:
                bar.update()
    if bar is not None:
        bar.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torch_fastload.vision.sample_data",
        description="Generate an ImageNet-like folder of real-photo JPEGs.",
    )
    parser.add_argument("root")
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--train-per-class", type=int, default=40)
    parser.add_argument("--val-per-class", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train, val = make_image_folder(args.root, args.classes, args.train_per_class, args.val_per_class, seed=args.seed)
    print(train, val)
    return 0


if __name__ == "__main__":
    sys.exit(main())

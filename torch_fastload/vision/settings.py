"""The image path's tunable numbers, each written once, with the reason for its value.

The options a user sets (``cpu_decode_share``, ``cpu_decode_threads``, ``cpu_decode_regions``,
``max_pixels``) live in ``torch_fastload.config``; these are the constants behind them.
"""

from __future__ import annotations

__all__ = [
    "GPU_MAX_PIXELS",
    "TRIAL_WARMUP",
    "TRIAL_SETTLE",
    "TRIAL_WINDOW",
    "TRIAL_KEEP_UP",
    "TRIAL_MARGIN",
    "TRIAL_CAUGHT_UP",
    "TRIAL_BUSY_GPU",
    "BALANCE_EVERY",
    "BALANCE_HISTORY",
    "BALANCE_GAIN",
    "BALANCE_SHARES",
    "CORES_FOR_A_TRIAL",
    "CORES_LEFT_TO_THE_STEP",
    "CPU_THREADS_BESIDE_NVJPEG",
    "DECODE_NICE",
    "PINNED_BUFFER_BYTES",
    "STEAL_CHUNK_MIN",
    "STEAL_CHUNKS_PER_BATCH",
    "NVIMGCODEC_CPU_THREADS",
    "ENGINE_BATCH_HINT",
]

# ImageFolder's gpu_max_pixels: larger JPEGs go to the CPU ('cpu:huge'), not to nvJPEG.
GPU_MAX_PIXELS = 8192 * 8192

# cpu_decode_share="auto" (the default, route_trial.py): the first TRIAL_WARMUP batches go to
# the CPU untimed (a model's first steps are slow: cuDNN autotuning, compilation); then each
# route decodes TRIAL_SETTLE batches untimed and at least TRIAL_WINDOW + 1 timed ones. The CPU
# route is kept at once if the loop waited less than TRIAL_KEEP_UP of its step for it (and the
# step ran at its GPU's pace: TRIAL_CAUGHT_UP below), else it
# must be TRIAL_MARGIN faster than nvJPEG to stay (H100: ResNet-18's CPU route timed 2% faster,
# then ran 34% slower a step).
TRIAL_WARMUP, TRIAL_SETTLE, TRIAL_WINDOW = 8, 4, 10
TRIAL_KEEP_UP = 0.1
TRIAL_MARGIN = 0.05
# ... and kept at once only if the step ran at its GPU's pace: the GPU still busy with the step
# when the loop asked for its next batch (step_probe.py: the GPU's gap inside next() over the
# host's, median over the window, below this). A step limited by its host thread (H200,
# ResNet-18: 59.7 ms a batch on the CPU route, DALI's step 26.6) has the GPU waiting: ~1.
TRIAL_CAUGHT_UP = 0.5
# Which side of a tie the windowed trial takes between nvJPEG alone and a split (the CPU beside
# it): where the step kept the GPU busy for at least this share of nvJPEG's batch period (the
# probe's median GPU step over that window), the split is kept unless nvJPEG alone beat it by
# TRIAL_MARGIN: beside a busy GPU every image the CPU takes is nvJPEG work off the step's SMs,
# and the windows (+-15%) do not see it (H100 ResNet-18: kept nvJPEG alone fed 27.5-32.2 ms a
# step, kept splits 25.6-27.6). On an idle GPU (the loader alone) nvJPEG alone is kept unless
# a split beat it by the margin, as before.
TRIAL_BUSY_GPU = 0.5
# A split the trial kept is balanced online (route_trial.ShareBalancer): every BALANCE_EVERY
# batches its CPU share moves BALANCE_GAIN of the way to the share that keeps both decoders
# equally busy, from their rates over the last BALANCE_HISTORY batches, within BALANCE_SHARES.
BALANCE_EVERY, BALANCE_HISTORY, BALANCE_GAIN = 4, 8, 0.5
BALANCE_SHARES = (0.05, 0.95)
# A process with fewer CPUs than this keeps nvJPEG without a trial: its CPU route cannot feed a GPU.
CORES_FOR_A_TRIAL = 8
# Cores the CPU decode threads leave when every JPEG may go to the CPU: the training thread and
# the loader's read and stage threads.
CORES_LEFT_TO_THE_STEP = 4
# Decode threads beside nvJPEG (the images it cannot take, a fixed share): min(this, CPUs).
CPU_THREADS_BESIDE_NVJPEG = 8
# Python decode threads run at nice +10 (the C++ decoder's pool too, csrc/engine.cpp): decoding
# yields its core to the training thread, whose kernel launches slowed ~2x without (H100).
DECODE_NICE = 10

# A stage thread's two pinned buffers for CPU-decoded images start at this size and grow to the
# largest batch's CPU-decoded bytes.
PINNED_BUFFER_BYTES = 1 << 24
# Work stealing: nvJPEG claims chunks of max(STEAL_CHUNK_MIN, batch / STEAL_CHUNKS_PER_BATCH)
# images (each call waits on the GPU twice, so not one image at a time).
STEAL_CHUNK_MIN = 16
STEAL_CHUNKS_PER_BATCH = 8
# nvImageCodec's decoder: its own CPU threads (bitstream parsing, the hybrid decoder's Huffman
# stage) beside the loader's decode threads and the training thread.
NVIMGCODEC_CPU_THREADS = 4
# The JPEG engines' decoder (jpeg_engines.py) preallocates for batches of this many images
# (nvImageCodec's nvjpeg_hw_decoder:preallocate_batch_size; DALI passes its batch size); the
# loader's first batch sets it where it is known.
ENGINE_BATCH_HINT = 256

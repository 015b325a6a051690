"""tf.data on the benchmark's PNGs; run by bench/input_pipeline.py with .venv-tf's Python.

    .venv-tf/bin/python bench/tf_input_pipeline.py FOLDER BATCH STEP_SECONDS CROP

The same work as the loom and DataLoader runs: read, decode, random crop, random flip,
normalize; parallel map and prefetch left to AUTOTUNE. Prints one JSON line, with the
timed epoch's CPU time (tf.data's threads all run in this process).
"""

import json
import sys
import time

import tensorflow as tf


def main() -> None:
    folder, batch, step_seconds, crop = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    classes = sorted(p.split("/")[-1] for p in tf.io.gfile.glob(f"{folder}/class*"))
    mean = tf.constant([0.49, 0.48, 0.45])
    std = tf.constant([0.25, 0.24, 0.26])

    def augment(path: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        label = tf.argmax(tf.cast(tf.equal(tf.strings.split(path, "/")[-2], classes), tf.int32))
        image = tf.io.decode_png(tf.io.read_file(path), channels=3)
        image = tf.image.random_flip_left_right(tf.image.random_crop(image, (crop, crop, 3)))
        return (tf.cast(image, tf.float32) / 255.0 - mean) / std, label

    files = tf.data.Dataset.list_files(f"{folder}/class*/*.png", shuffle=True, seed=0)
    dataset = files.map(augment, num_parallel_calls=tf.data.AUTOTUNE).batch(batch).prefetch(tf.data.AUTOTUNE)
    seconds = cpu = samples = 0
    for _ in range(2):  # the second epoch is timed, as for the others
        start, used, samples = time.perf_counter(), time.process_time(), 0
        for _, labels in dataset:
            samples += int(labels.shape[0])
            if step_seconds:
                time.sleep(step_seconds)
        seconds, cpu = time.perf_counter() - start, time.process_time() - used
    steps = -(-samples // batch)
    print(json.dumps({
        "name": "tf.data map(AUTOTUNE) + prefetch(AUTOTUNE)",
        "samples_per_sec": samples / seconds,
        "step_ms": seconds / steps * 1e3,
        "cpu_ms_per_batch": cpu / steps * 1e3,  # every tf.data thread is in this process
        "tensorflow": tf.__version__,
    }))


if __name__ == "__main__":
    main()

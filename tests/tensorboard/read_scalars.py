"""Prints, as JSON, every scalar TensorBoard reads from the event files of a directory:
{tag: [[step, value], ...]}, in step order. TensorBoard's own loader (EventAccumulator) reads
them, so a file it cannot read, or a record whose CRC is wrong, shows up here.

    python read_scalars.py LOGDIR
"""

import json
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

accumulator = EventAccumulator(sys.argv[1])
accumulator.Reload()
scalars = {
    tag: [[event.step, event.value] for event in accumulator.Scalars(tag)]
    for tag in accumulator.Tags()["scalars"]
}
print(json.dumps(scalars))

"""Feeding the trainer: one pass of batches from this process, worker processes or a device.

In: a plan and the loader's position (epoch, batches taken). Out: batches as tensors, each a
view of a reused buffer, of a worker's shared-memory slot, or cut on the device from blocks
uploaded once; and the position moved on by each batch handed out. Modules, in import order:
``stats`` (run totals), ``device`` (device blocks and gather), ``slots`` (shared memory, and the
batches made ahead over it), ``protocol`` (records in shared-memory rings), ``sizing`` (limits on
workers and slots), ``worker`` (the worker process), ``pool`` (its trainer side), ``feeds``
(in-process and worker passes), ``device_feeds`` (device passes).
"""

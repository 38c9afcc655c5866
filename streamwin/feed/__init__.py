"""Feeding the trainer: one pass of batches from this process, worker processes or a device.

In: a plan and the loader's position (epoch, batches taken). Out: batches as tensors, each a
view of a reused buffer or of a worker's shared-memory slot, or on the device (copied there in
one piece per batch, or cut there from blocks uploaded once); and the position moved on by
each batch handed out. Modules, in import order: ``stats`` (run totals), ``to_device`` (a batch
buffer to the device in one copy; static batches), ``device`` (device blocks and gather),
``slots`` (shared memory, and the batches made ahead over it), ``protocol`` (records in
shared-memory rings), ``sizing`` (limits on workers and slots), ``worker`` (the worker process),
``pool`` (its trainer side), ``feeds`` (in-process and worker passes), ``device_feeds`` (device passes).
"""

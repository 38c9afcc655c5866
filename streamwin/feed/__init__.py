"""Feeding the trainer: one pass of batches from this process, worker processes or a device.

In: a plan and a position (epoch, batches taken). Out: batches as tensors, each a view of a
reused buffer, a worker's shared-memory slot, or windows cut on the device from blocks
uploaded once; and the position moved on by each batch handed out.
"""

"""The BPF programs and their attach: ``bpfsrc`` builds and compiles the
program, ``bpfcache`` and ``bpfload`` keep and load what a compile produced,
``probes`` is the attach ladder, ``modes`` how much of each call is measured,
``mapwatch`` holds a process at its first CUDA mapping, ``rings`` and ``ringbuf`` read
the ring buffers in bulk and ``decoder`` turns their records into store rows.
"""

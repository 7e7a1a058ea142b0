"""NumPy mirrors of the NKI kernels in kernels/nki/: the same tile loops, tile sizes, running statistics and
rounding points, written so a CPU can check a kernel's algorithm against its torch twin.

A mirror shows the tiling is right (partition tiles <= 128, online softmax across KV blocks, GQA grouping,
ragged page tables, masks); it says nothing about whether the NKI code compiles or runs on a NeuronCore.
Each function asserts the kernel's shape constraints, so a mirror cannot quietly cover a shape the kernel
would refuse. Values are computed in float32, as the engines do; results are cast to the input dtype at the
points where the kernel writes a tile of that dtype (exact for float16 and float32 inputs; NumPy has no
bfloat16, so bf16 is checked on the device only).
"""

PMAX = 128  # partitions: the largest partition-dim tile

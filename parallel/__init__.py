"""
How ranks share one model: data parallel, FSDP, pipeline and tensor parallel, their checkpoints, and the choice among
them. The model (model.py) knows nothing of ranks: these modules wrap it or cut it from outside. Read in this order:

  sizes.py            what every layout counts alike: parameters, bytes a parameter, the memory of a rank, GiB, a
                      sharded tensor's local piece, micro-steps and a micro-batch's weight (imports nothing above it)
  mesh.py             where each rank sits: its replica, stage and tensor-parallel rank on the mesh; its node
  world.py            the ranks: launchers, the process group, the device, agreed stop signals, weights checked alike
  sharding.py         FSDP2 (--shard full, grads): each rank a piece of every weight; what DDP and FSDP send
  build.py            a model built as this rank holds it (FSDP's pieces, a stage, a share), never whole
  stage_split.py      where --pp cuts the blocks into stages, and what each stage then holds and sends
  stage.py            one pipeline stage as a module: the GPT with the other stages' parts removed
  tensor_parallel.py  --tp: each block's matmuls split over ranks, its step, its checkpoints
  pipeline.py         --pp: the stages on a (dp, pp, tp) mesh, their schedule, their checkpoints
  parts.py            a rank's part of a checkpoint: .dcp folders written and read in pieces, by any layout
  node_disks.py       a disk per node: who shares --log_dir, what each disk keeps, files sent where they lack
  cluster.py          what --parallel auto measures: free memory, crowded cores, links, a block's time
  layouts.py          --parallel auto: the layout predicted fastest from the measurements and the memory model
"""

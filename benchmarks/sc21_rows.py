"""The published runs of Narayanan et al., "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM" (SC21, arXiv 2104.04473), as ``benchmarks/megatron_sc21.py``
prices them.

:data:`ROWS`: Table 1, ten GPT models on 32 to 3,072 A100-80GB GPUs; the microbatch size,
the interleaving and the recomputation of every block from Megatron-LM's
``examples/sc21/run_table_1.sh``. :data:`TABLE_2`: Table 2, PTD-P against ZeRO-3 without
model parallelism for the 174.6B (GPT-3) and 529.6B models, its figures as the paper's
table prints them, checked against its text (§5.2: PTD-P 6% and 24% faster with the fewest
GPUs, 70% faster at twice as many) and against the table's own training days by its
Eq. (4). The paper gives no run script for Table 2: PTD-P's interleaving is taken from the
scripts of the same model and layout (``run_figure_12.sh`` for 174.6B on t8-p12,
``run_table_1.sh`` for 529.6B on t8-p35); ZeRO-3 runs one stage, every block recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

from dreampipe.planning.layout import Layout
from dreampipe.planning.topology import Topology
from dreampipe.profiling.gpt_spec import GptSpec, parse_gpt_spec

__all__ = ["ROWS", "TABLE_2", "Sc21Row"]


@dataclass(frozen=True)
class Sc21Row:
    """One published run: the model's shape, its layout (``t``, ``p``, ``v`` virtual
    stages, ZeRO level ``zero``), GPUs, global batch, microbatch size and teraFLOP/s per
    GPU; ``scheme`` names Table 2's (empty in Table 1). Every block is recomputed."""

    name: str
    heads: int
    hidden: int
    layers: int
    t: int
    p: int
    gpus: int
    batch: int
    microbatch: int
    v: int
    tflops: float
    zero: int = 0
    scheme: str = ""

    @property
    def label(self) -> str:
        """The row's name in the tables: the model, and Table 2's scheme and GPUs."""
        return f"{self.name} {self.scheme} x{self.gpus}" if self.scheme else self.name

    @property
    def spec(self) -> GptSpec:
        return parse_gpt_spec(f"gpt:layers={self.layers},hidden={self.hidden},"
                              f"heads={self.heads},seq=2048,vocab=51200")

    @property
    def layout(self) -> Layout:
        """t, p, v and the ZeRO level as published; every block of a stage (a chunk)
        recomputed."""
        return Layout(self.t, self.p, self.v, self.zero or None,
                      self.layers // (self.p * self.v))

    @property
    def topology(self) -> Topology:
        return Topology.parse(f"dgx-a100:{self.gpus // 8}")


ROWS = (
    Sc21Row("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 1, 137),
    Sc21Row("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, 1, 138),
    Sc21Row("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, 1, 142),
    Sc21Row("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 8, 1, 135),
    Sc21Row("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 4, 1, 138),
    Sc21Row("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, 140),
    Sc21Row("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, 148),
    Sc21Row("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, 155),
    Sc21Row("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, 163),
    Sc21Row("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, 163),
)


#: Table 2's models: name, heads, hidden, layers, and PTD-P's t, p and v.
_MODELS = {"174.6B": ("174.6B", 96, 12288, 96, 8, 12, 4),
           "529.6B": ("529.6B", 128, 20480, 105, 8, 35, 3)}


def _table_2(model: str, gpus: int, batch: int, microbatch: int, tflops: float,
             zero: bool) -> Sc21Row:
    """A Table 2 row: ZeRO-3 runs one stage on every GPU, PTD-P the model's layout."""
    name, heads, hidden, layers, t, p, v = _MODELS[model]
    if zero:
        t, p, v = 1, 1, 1
    return Sc21Row(name, heads, hidden, layers, t, p, gpus, batch, microbatch, v, tflops,
                   3 if zero else 0, "ZeRO-3" if zero else "PTD-P")


#: Table 2 in the paper's order; the 640-GPU ZeRO-3 row runs a batch of 2,560 (the
#: table's footnote: 529.6B did not fit 560 GPUs at a microbatch of 4).
TABLE_2 = (
    _table_2("174.6B", 384, 1536, 4, 144, True), _table_2("174.6B", 768, 1536, 2, 88, True),
    _table_2("174.6B", 1536, 1536, 1, 44, True),
    _table_2("529.6B", 640, 2560, 4, 138, True), _table_2("529.6B", 1120, 2240, 2, 98, True),
    _table_2("529.6B", 2240, 2240, 1, 48, True),
    _table_2("174.6B", 384, 1536, 1, 153, False), _table_2("174.6B", 768, 1536, 1, 149, False),
    _table_2("174.6B", 1536, 1536, 1, 141, False),
    _table_2("529.6B", 560, 2240, 1, 171, False), _table_2("529.6B", 1120, 2240, 1, 167, False),
    _table_2("529.6B", 2240, 2240, 1, 159, False),
)

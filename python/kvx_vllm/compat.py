"""Stand-ins for the parts of vLLM's connector API that older releases lack, so that no module
of the plugin imports a name bare that some supported release does not have (docs/vllm.md,
"vLLM releases")."""

from __future__ import annotations

from dataclasses import dataclass, field

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # vLLM 0.29: the worker reports through get_finished and
    # get_block_ids_with_load_errors only (a failed load by its blocks).

    @dataclass
    class KVConnectorTransferResults:  # type: ignore[no-redef]
        """What a worker's step finished: sends, receives, and the receives that failed
        (these are among ``finished_recving`` too)."""

        finished_sending: set[str] = field(default_factory=set)
        finished_recving: set[str] = field(default_factory=set)
        failed_recving: set[str] = field(default_factory=set)

__all__ = ["KVConnectorTransferResults"]

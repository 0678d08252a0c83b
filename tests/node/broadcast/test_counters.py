"""Counters that are right (issue 29.3: a relay that mirrored 16 versions counted 2 in
`bytes_downloaded` and listed 2 downloads). A real relay role over a real broadcaster and
libp2p host mirrors 16 versions of a real trainer's broadcaster; every counter is compared
with what the two nodes actually did, and /metrics shows the broadcast counters."""

from __future__ import annotations

import logging

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from swarm_node.node.identity import Identity
from swarm_node.node.metrics import NodeState
from swarm_node.node.roles.relay import RelayRole

from .conftest import make_checkpoint, node_config, until, wait_mesh

VERSIONS = 16


async def test_a_relay_counts_every_version_it_mirrored(tmp_path, swarm, caplog):
    from swarm_node.node.p2p import P2PNode

    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 150_000})  # 3 shards
    tnode, trainer = await swarm("trainer", "trainer")
    tid = tnode.peer_id
    cfg = node_config(node__role="relay", node__follow=[tid], node__data_dir=tmp_path / "relay")
    ident = Identity.generate()
    p2p = P2PNode(ident, cfg)
    await p2p.start(bootstrap=tnode.listen_addrs)
    state = NodeState(ident.peer_id, "relay", "default")
    role = RelayRole(cfg, ident, p2p, state)
    try:
        with caplog.at_level(logging.INFO):
            await role.start()
            await wait_mesh(tnode, "checkpoints", 1)
            for v in range(1, VERSIONS + 1):
                m = await trainer.publish(ckpt, version=v)
                await until(lambda v=v: state.counters["versions_mirrored"] >= v,
                            what=f"v{v} mirrored")
        feed = role.feed.counters()
        size = m.total_size
        assert [d["version"] for d in state.downloads] == list(range(1, VERSIONS + 1))
        assert [d["bytes"] for d in state.downloads] == [size] * VERSIONS
        served = trainer.server.metrics["bytes_sent"]  # the relay is its only client
        assert state.counters["bytes_downloaded"] == feed["bytes_downloaded"] == served \
            == VERSIONS * size
        assert feed["downloads_completed"] == feed["downloads_started"] == VERSIONS
        assert feed["shards_downloaded"] == VERSIONS * m.num_shards
        assert feed["bytes_fetched"] == VERSIONS * size  # nothing wasted, nothing corrupt
        assert trainer.counters()["versions_published"] == VERSIONS
        assert trainer.counters()["served_shards_sent"] == VERSIONS * m.num_shards
        assert state.histograms["download_seconds"].count == VERSIONS
        scraped = {s.labels["name"]: s.value for f in text_string_to_metric_families(
            generate_latest(state.registry).decode()) if f.name == "swarm_node_broadcast"
            for s in f.samples}
        assert scraped["bytes_downloaded"] == VERSIONS * size
        assert scraped["downloads_completed"] == VERSIONS
        # the gossiped manifest is not fetched again from the trainer's advert
        assert feed.get("manifest_pulls", 0) <= 2
        assert state.status()["components"]["broadcast"]["bytes_downloaded"] == VERSIONS * size
        # routine rejections (a version already here, pulled again) are not INFO noise
        noisy = [r.getMessage() for r in caplog.records
                 if r.levelno >= logging.INFO and "not_newer" in r.getMessage()]
        assert noisy == []
    finally:
        await role.close()
        await p2p.close()

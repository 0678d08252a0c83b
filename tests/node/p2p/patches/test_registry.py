"""The patch registry: every patch still applies to the installed py-libp2p (its targets
have the shape it was written for, and the upstream code it re-implements is unchanged),
each has a test showing py-libp2p still needs it, `install()` is idempotent, and the
version gate refuses a py-libp2p the patches no longer fit."""

from __future__ import annotations

import importlib
import logging
import pkgutil

import libp2p
import libp2p.pubsub.pubsub as pubsub_mod
import pytest
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from swarm_node.node.p2p import patches
from swarm_node.node.p2p.patches import internals
from swarm_node.node.p2p.patches.registry import (
    PATCHES,
    PINNED_LIBP2P,
    PatchError,
    check_version,
    fingerprint,
    original,
    resolve,
)

from . import test_host_patches, test_pubsub_patches, test_relay_patches, test_transport_patches


def test_the_pinned_libp2p_is_installed():
    assert libp2p.__version__ == PINNED_LIBP2P


@pytest.mark.parametrize("name", sorted(PATCHES))
def test_patch_still_applies(name):
    patch = PATCHES[name]
    assert patch.shape() == [], "the patched target changed shape: review the patch"
    for target, pinned in patch.fingerprints.items():
        assert fingerprint(original(*resolve(target))) == pinned, (
            f"py-libp2p changed {target}, which {name} re-implements: review the patch "
            "against the new code, then update the fingerprint")
    assert patch.why and patch.upstream and patch.targets


def test_every_patch_has_a_test_showing_it_is_still_needed():
    tests = {n for mod in (test_host_patches, test_pubsub_patches, test_transport_patches,
                           test_relay_patches)
             for n in dir(mod) if n.startswith("test_needed_")}
    assert tests == {f"test_needed_{name}" for name in PATCHES}


def test_every_patch_module_registers_what_it_replaces():
    package = patches.__path__
    modules = {m.name for m in pkgutil.iter_modules(package)} - {"registry", "internals"}
    registered = {p.shape.__module__.rsplit(".", 1)[-1] for p in PATCHES.values()}
    for name in modules:
        importlib.import_module(f"{patches.__name__}.{name}")
    assert modules == registered


def test_the_private_reads_fit_the_pinned_libp2p_and_notice_a_rename(monkeypatch):
    assert internals.problems() == []
    monkeypatch.delattr(CircuitV2Protocol, "_handle_hop_stream")
    assert internals.problems() == ["CircuitV2Protocol._handle_hop_stream is gone"]


def test_install_is_idempotent():
    patches.install()
    before = {t: getattr(*resolve(t)) for p in PATCHES.values() if p.scope == "process"
              for t in p.targets}
    patches.install()
    assert {t: getattr(*resolve(t)) for t in before} == before
    assert pubsub_mod.signature_validator is not original(pubsub_mod, "signature_validator")


def test_another_version_warns_when_the_patches_apply(caplog):
    with caplog.at_level(logging.WARNING):
        assert check_version("0.9.0") is False
    assert "written for 0.8.1" in caplog.text


def test_another_version_is_refused_when_a_patch_no_longer_applies(monkeypatch):
    monkeypatch.delattr(pubsub_mod.Pubsub, "_handle_dead_peer")
    with pytest.raises(PatchError, match="keep_subscriptions_while_connected"):
        check_version("0.9.0")
    assert check_version(PINNED_LIBP2P) is True  # the pinned release is trusted as tested

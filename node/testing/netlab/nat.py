"""A home router's NAT and filter, as nftables rules written over netlink (pyroute2).

  table ip netlab_nat    { chain post { type nat hook postrouting priority 100;
                                        oifname "eth0" masquerade [fully-random] } }
  table ip netlab_filter { chain input   { type filter hook input priority 0;
                                           iifname "eth0" ct state new drop }
                           chain forward { type filter hook forward priority 0;
                                           iifname "eth0" ct state new drop } }

Without flags Linux MASQUERADE keeps a connection's source port whenever the resulting tuple is
free, and the same LAN port towards two servers keeps the same public port: an endpoint-
independent, port-preserving mapping ("cone"). `fully-random` picks a random public port per
connection ("symmetric"): a peer told the port seen by one server cannot predict the next one.
Inbound, only the conntrack's replies pass; a new connection from outside is dropped silently
(a real home router sends no RST), which is also what lets two TCP SYNs cross for a hole punch.
"""

from __future__ import annotations

import struct

from pyroute2.netlink.nfnetlink.nftsocket import Meta, Regs
from pyroute2.nftables.expressions import genex
from pyroute2.nftables.main import NFTables

from .errors import NetlabError
from .topology import NAT_TYPES

WAN = "eth0"
CT_STATE_NEW = 0x08  # nft's `ct state new` bit
NF_ACCEPT, NF_DROP = 1, 0
NFT_CMP_EQ, NFT_CMP_NEQ = 0, 1
NFT_CT_STATE = 0x00
NAT_PRIORITY = 100


def _iifname_is(name: str, oif: bool = False) -> list:
    key = Meta.NFT_META_OIFNAME if oif else Meta.NFT_META_IIFNAME
    return [
        genex("meta", {"key": int(key), "dreg": int(Regs.NFT_REG_1)}),
        genex("cmp", {"sreg": int(Regs.NFT_REG_1), "op": NFT_CMP_EQ,
                      "data": {"attrs": [("NFTA_DATA_VALUE", name.encode().ljust(16, b"\0"))]}}),
    ]


def _ct_state_new() -> list:
    mask = struct.pack("=I", CT_STATE_NEW)
    return [
        genex("ct", {"key": NFT_CT_STATE, "dreg": int(Regs.NFT_REG_1)}),
        genex("bitwise", {"sreg": int(Regs.NFT_REG_1), "dreg": int(Regs.NFT_REG_1), "len": 4,
                          "mask": {"attrs": [("NFTA_DATA_VALUE", mask)]},
                          "xor": {"attrs": [("NFTA_DATA_VALUE", b"\0\0\0\0")]}}),
        genex("cmp", {"sreg": int(Regs.NFT_REG_1), "op": NFT_CMP_NEQ,
                      "data": {"attrs": [("NFTA_DATA_VALUE", b"\0\0\0\0")]}}),
    ]


def _verdict(code: int) -> list:
    return [genex("immediate", {
        "dreg": int(Regs.NFT_REG_VERDICT),
        "data": {"attrs": [("NFTA_DATA_VERDICT", {"attrs": [("NFTA_VERDICT_CODE", code)]})]},
    })]


def install_home_nat(nat: str) -> None:
    """Install the rules in the calling thread's network namespace (a home router's)."""
    if nat not in NAT_TYPES:
        raise NetlabError(f"unknown NAT type {nat!r}")
    flags = ["NF_NAT_RANGE_PROTO_RANDOM_FULLY"] if nat == "symmetric" else []
    nft = NFTables(nfgen_family=2)  # NFPROTO_IPV4
    try:
        nft.table("add", name="netlab_nat")
        nft.chain("add", table="netlab_nat", name="post", hook="postrouting", type="nat",
                  priority=NAT_PRIORITY, policy=NF_ACCEPT)
        masq = [genex("masq", {"flags": flags})] if flags else [genex("masq", {})]
        nft.rule("add", table="netlab_nat", chain="post",
                 expressions=(_iifname_is(WAN, oif=True), masq))
        nft.table("add", name="netlab_filter")
        for chain in ("input", "forward"):
            nft.chain("add", table="netlab_filter", name=chain, hook=chain, type="filter",
                      priority=0, policy=NF_ACCEPT)
            nft.rule("add", table="netlab_filter", chain=chain,
                     expressions=(_iifname_is(WAN), _ct_state_new(), _verdict(NF_DROP)))
    finally:
        nft.close()

"""The swarm-node wire: message schemas, codecs, signed envelopes, protocol IDs and limits.

Nothing here imports torch, transformers or libp2p, so decoding stays cheap and `--help` fast.
"""

# 2: sampling noise v2 (counter-based hash); manifest settings carry the prompt style
# (system_prompt, few_shot) and generator params (task_params). History: NODE_SPEC.md 1.8
PROTOCOL_VERSION = 2

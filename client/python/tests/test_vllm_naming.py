"""kvq.vllm's sequence names: a prompt's whole-prompt name is its last block name when it ends
on a block boundary, and otherwise a name of its own for every partial last block (its ids and
its length), keeping the first block's hash tag so a sharded kvq routes it beside its prefixes.
Needs no vLLM (kvq.vllm imports the connector only on first use)."""

from __future__ import annotations

import re

from kvq.vllm.naming import PrefixNames

BS = 128


def names_of(ids):
    n = PrefixNames("m", BS, {"codec": {}})
    chain = n.chain(ids)
    return chain, n.whole(ids, chain)


def test_a_prompt_of_whole_blocks_is_named_by_its_last_block():
    ids = list(range(3 * BS))
    chain, whole = names_of(ids)
    assert len(chain) == 3 and whole == chain[-1]


def test_a_partial_last_block_gets_a_name_of_its_own_per_content_and_length():
    base = list(range(3 * BS))
    chain, whole = names_of(base + [7, 8, 9])
    assert chain == names_of(base)[0] and whole not in chain
    assert whole.startswith(chain[-1] + ".")
    others = {names_of(base + tail)[1] for tail in ([7, 8, 10], [7, 8], [7, 8, 9, 0], [0] * BS)}
    assert whole not in others and len(others) == 4
    assert re.search(r"\{([0-9a-f]{16})\}", whole).group(1) == re.search(r"\{([0-9a-f]{16})\}", chain[0]).group(1)
    assert len(whole) <= 256  # kvq's limit on a sequence id


def test_the_settings_change_every_name():
    ids = list(range(BS + 5))
    a = PrefixNames("m", BS, {"codec": {}})
    b = PrefixNames("m", BS, {"codec": {"window": 4096}})
    assert a.whole(ids, a.chain(ids)) != b.whole(ids, b.chain(ids))

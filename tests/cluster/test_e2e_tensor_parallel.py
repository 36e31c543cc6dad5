"""The real app with two engine replicas of tensor_parallel_size 2 (`prefixserve serve --tensor-parallel-size 2`)
on CPU: each replica's two ranks are Ray actors (gloo) in its placement group. Through the openai client they
give the greedy tokens of one process (fp32); when one rank is killed while streams run on both replicas, that
replica's streams migrate and end exactly as undisturbed, and Serve replaces the replica whole."""
import asyncio
import os
import signal

import httpx
import openai
import pytest
from ray._private import state

from cluster.app import APP_NAME
from cluster.config import ClusterConfig
from replica.engine import LLM
from replica.request import SamplingParams
from tests.executor.test_hf_directory import save_model

from .test_e2e import served
from .test_e2e_multinode import assert_migrated_and_replaced, deployment_replicas, stream

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = [f"Story {i}: once upon a time, in a town by the sea," for i in range(4)]
MAX_TOKENS = 160
RECOVERY_TIMEOUT_S = 120
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    directory, _ = save_model("llama", tmp_path_factory)  # 4 query heads, 2 KV heads: one of each per rank
    config = ClusterConfig(engine={"model": str(directory), "dtype": "float32", "device": "cpu", "num_kv_blocks": 128,
                                   "tensor_parallel_size": 2}, num_replicas=2)
    with served(config) as base_url:
        yield base_url, directory


def rank_pids() -> dict[str, list[int]]:
    """Engine replica id -> the pids of its live rank actors (each owned by its replica's actor)."""
    actors = [actor for actor in state.actors().values() if actor["State"] == "ALIVE"]
    replica_of_port = {actor["Address"]["Port"]: actor["Name"].rsplit("#", 1)[-1] for actor in actors
                       if actor["Name"].startswith(f"SERVE_REPLICA::{APP_NAME}#engine#")}
    pids: dict[str, list[int]] = {}
    for actor in actors:
        if actor["ActorClassName"].endswith("Rank"):
            pids.setdefault(replica_of_port[actor["OwnerAddress"]["Port"]], []).append(actor["Pid"])
    return pids


def test_two_ranks_serve_the_tokens_of_one_process(app):
    base_url, directory = app
    assert {replica: len(pids) for replica, pids in rank_pids().items()} == {
        replica: 2 for replica in deployment_replicas()}
    one_process = LLM(str(directory), dtype="float32", device="cpu", num_kv_blocks=32)
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        for prompt in PROMPTS:
            completion = client.completions.create(model=directory.name, prompt=prompt, max_tokens=8, temperature=0,
                                                   extra_body={"ignore_eos": True})
            assert completion.choices[0].text == one_process.generate(prompt, GREEDY)[0].text


async def run_and_kill_a_rank(base_url: str, model: str) -> tuple[list, str]:
    """Streams PROMPTS at once; when both replicas stream, kills a rank of one. -> (results, its replica)"""
    started: asyncio.Queue = asyncio.Queue()
    async with httpx.AsyncClient(base_url=base_url, timeout=RECOVERY_TIMEOUT_S) as client:
        streams = asyncio.gather(*(stream(client, prompt, started, model=model, max_tokens=MAX_TOKENS)
                                   for prompt in PROMPTS))
        streaming = set()
        while len(streaming) < 2:
            streaming.add(await asyncio.wait_for(started.get(), RECOVERY_TIMEOUT_S))
        victim = sorted(streaming)[0]
        os.kill(max(rank_pids()[victim]), signal.SIGKILL)
        return await asyncio.wait_for(streams, RECOVERY_TIMEOUT_S), victim


def test_killing_a_rank_migrates_its_replicas_streams_and_replaces_the_replica(app):
    base_url, directory = app
    body = {"model": directory.name, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    undisturbed = [httpx.post(f"{base_url}/v1/completions", json={**body, "prompt": prompt}, timeout=120)
                   .json()["choices"][0]["text"] for prompt in PROMPTS]

    results, victim = asyncio.run(run_and_kill_a_rank(base_url, directory.name))

    assert_migrated_and_replaced(base_url, body, PROMPTS, results, undisturbed, victim)
    assert sorted(map(len, rank_pids().values())) == [2, 2]  # the replacement has ranks of its own

"""Seeded synthetic workloads shaped like production traffic, as programs of turns.

A program is what one user or agent sends: its turns arrive one after another, each after the
previous one finished plus a gap (think time, a tool call). A turn's prompt is the previous
turn's prompt, the previous answer (the tokens the simulated model emits) and something new, so
history hashes equal what the replica cached. Token ids are random in SmolLM2's vocabulary;
prefixes that are shared are the same token lists, so their block hashes are equal.

Sizes scale with the number of replicas n, so every replica's share of distinct prefixes is the
same at every n. Lengths are in tokens; U(a, b) is uniform on integers.

- system-prompts: 3n system prompts of U(1000, 3000), Zipf(1.0) popularity; every request is a
  new user's single question U(20, 200) with an answer U(10, 60).
- multi-turn: chats of 1 + ceil(Exp(mean 4)) turns (at most 12), all starting with the chat
  template's 32-token header (the default system prompt: one block everyone shares); user
  messages U(30, 300), answers U(20, 100), think time Exp(mean 8 s) between turns.
- agents: programs of U(10, 30) turns; one of 4 agent system prompts U(1000, 2000) after the
  template header, a task U(100, 300); each turn emits a tool call U(15, 50), then waits a
  tool gap lognormal(median 3 s, sigma 0.6) clipped to [1, 10] s and appends a tool result
  U(50, 400); a program ends early when its context passes 7000 tokens.
- coding-agents: shaped like coding agents on SWE-bench-style tasks: programs of U(10, 50) turns; one
  of 4 agent system prompts U(2000, 4000) after the template header, an issue U(200, 800); each turn
  emits a tool call U(20, 100), then waits a tool gap lognormal(median 4 s, sigma 0.9) clipped to
  [1, 30] s (tests, builds, searches) and appends a tool result U(300, 2000) (files, test output); a
  program ends early when its context passes its own limit, U(20000, 60000) tokens.
- document-qa: 2n documents U(3000, 6000), Zipf(1.0) popularity; single questions U(15, 60)
  with answers U(10, 60).
Answers are shorter than production's to keep runs to minutes (every decode step is a real
scheduler step); TTFT is set by prefill and queueing, which they shorten only a little.
"""
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

_VOCAB_IDS = range(100, 49152)  # SmolLM2's vocabulary, special tokens left out
TEMPLATE_HEADER_TOKENS = 32
MAX_CONTEXT = 7000  # every workload's but coding-agents'
CODING_MAX_CONTEXT = 60_000


@dataclass
class Turn:
    prompt: list[int]
    output: list[int]  # what the simulated model emits, token by token
    gap_s: float = 0.0  # after the previous turn finished; 0 for a program's first turn


@dataclass
class Program:
    session_id: str
    turns: list[Turn] = field(default_factory=list)
    start_s: float = 0.0


def _draw(rng: random.Random, low: int, high: int) -> list[int]:
    """U(low, high) token ids."""
    return rng.choices(_VOCAB_IDS, k=rng.randint(low, high))


def _zipf_weights(count: int, exponent: float = 1.0) -> list[float]:
    return [1.0 / (rank + 1) ** exponent for rank in range(count)]


def _single_turns(rng: random.Random, num_programs: int, prefixes: list[list[int]],
                  question: tuple[int, int], answer: tuple[int, int], name: str) -> list[Program]:
    weights = _zipf_weights(len(prefixes))
    return [Program(f"{name}{i}", [Turn(rng.choices(prefixes, weights)[0] + _draw(rng, *question),
                                        _draw(rng, *answer))])
            for i in range(num_programs)]


def system_prompts(rng: random.Random, num_replicas: int, num_requests: int) -> list[Program]:
    prompts = [_draw(rng, 1000, 3000) for _ in range(3 * num_replicas)]
    return _single_turns(rng, num_requests, prompts, (20, 200), (10, 60), "user")


def document_qa(rng: random.Random, num_replicas: int, num_requests: int) -> list[Program]:
    documents = [_draw(rng, 3000, 6000) for _ in range(2 * num_replicas)]
    return _single_turns(rng, num_requests, documents, (15, 60), (10, 60), "question")


def multi_turn(rng: random.Random, num_replicas: int, num_requests: int) -> list[Program]:
    header = _draw(rng, TEMPLATE_HEADER_TOKENS, TEMPLATE_HEADER_TOKENS)
    programs, num_turns = [], 0
    while num_turns < num_requests:
        length = min(1 + math.ceil(rng.expovariate(1 / 4)), 12)
        program = Program(f"chat{len(programs)}")
        _grow(program, rng, header, length, (30, 300), (20, 100), lambda: rng.expovariate(1 / 8))
        programs.append(program)
        num_turns += len(program.turns)
    return programs


def agents(rng: random.Random, num_replicas: int, num_requests: int) -> list[Program]:
    def grow(program: Program, start: list[int]) -> None:
        _grow(program, rng, start, rng.randint(10, 30), (50, 400), (15, 50),
              lambda: min(max(rng.lognormvariate(math.log(3), 0.6), 1.0), 10.0))

    return _agent_programs(rng, num_requests, "agent", (1000, 2000), (100, 300), grow)


def coding_agents(rng: random.Random, num_replicas: int, num_requests: int) -> list[Program]:
    def grow(program: Program, start: list[int]) -> None:
        _grow(program, rng, start, rng.randint(10, 50), (300, 2000), (20, 100),
              lambda: min(max(rng.lognormvariate(math.log(4), 0.9), 1.0), 30.0),
              max_context=rng.randint(20_000, CODING_MAX_CONTEXT))

    return _agent_programs(rng, num_requests, "coder", (2000, 4000), (200, 800), grow)


def _agent_programs(rng: random.Random, num_requests: int, name: str, system_prompt: tuple[int, int],
                    task: tuple[int, int], grow: Callable[[Program, list[int]], None]) -> list[Program]:
    """Programs until they bring num_requests turns, each starting from one of 4 system prompts and a task."""
    header = _draw(rng, TEMPLATE_HEADER_TOKENS, TEMPLATE_HEADER_TOKENS)
    system = [header + _draw(rng, *system_prompt) for _ in range(4)]
    programs, num_turns = [], 0
    while num_turns < num_requests:
        program = Program(f"{name}{len(programs)}")
        grow(program, rng.choice(system) + _draw(rng, *task))
        programs.append(program)
        num_turns += len(program.turns)
    return programs


def _grow(program: Program, rng: random.Random, context: list[int], num_turns: int, new_input: tuple[int, int],
          answer: tuple[int, int], gap: Callable[[], float], max_context: int = MAX_CONTEXT) -> None:
    """Append turns, each one's prompt = context so far + new input; stop before max_context."""
    for index in range(num_turns):
        prompt = context + _draw(rng, *new_input)
        output = _draw(rng, *answer)
        if len(prompt) + len(output) > max_context:
            return
        program.turns.append(Turn(prompt, output, gap() if index else 0.0))
        context = prompt + output


WORKLOADS: dict[str, Callable[[random.Random, int, int], list[Program]]] = {
    "system-prompts": system_prompts, "multi-turn": multi_turn, "agents": agents, "document-qa": document_qa,
    "coding-agents": coding_agents}


def max_context(workload: str) -> int:
    """The longest prompt and answer a workload's turn brings, in tokens."""
    return CODING_MAX_CONTEXT if workload == "coding-agents" else MAX_CONTEXT


def make_workload(name: str, seed: int, num_replicas: int, num_requests: int) -> list[Program]:
    return WORKLOADS[name](random.Random(seed), num_replicas, num_requests)


def assign_starts(programs: list[Program], requests_per_s: float, seed: int) -> None:
    """Poisson program starts at the rate that makes turns arrive at requests_per_s on average."""
    rng = random.Random(seed)
    turns_per_program = sum(len(p.turns) for p in programs) / len(programs)
    now = 0.0
    for program in programs:
        now += rng.expovariate(requests_per_s / turns_per_program)
        program.start_s = now

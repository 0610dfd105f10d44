"""Write docs/diagnostics.md: every diagnostic code with its explanation and a rendered example.

    python3 tests/checks/make_diagnostics_doc.py          # rewrite docs/diagnostics.md
    python3 tests/checks/make_diagnostics_doc.py --check  # exit 1 when the file is stale

Examples of the parse codes (MW0xx) are rendered from the small inputs below; examples of the
check codes (MW1xx-MW4xx) are the golden fixtures of tests/checks/fixtures, rendered exactly as
test_golden.py expects them. tests/checks/test_docs.py fails when the document is stale.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from checks_golden import FIXTURES, render_fixture  # noqa: E402
from mstar.compiler import codes as comp_codes  # noqa: E402
from mstar.lang import codes as lang_codes  # noqa: E402
from mstar.lang.diagnostics import Diagnostics  # noqa: E402
from mstar.lang.parser import parse  # noqa: E402

DOC = ROOT / "docs" / "diagnostics.md"

HEAD = "model m\n"
NODE = "node LLM kv(layers=2) {\n    in text_inputs\n%s}\n"
lang_cases = {
 "MW001": (HEAD + "node LLM kv(layers=2) {\n    in text_inputs $\n}\n",
     "A character that no token of the language starts with. Remove it; comments start with `#`."),
 "MW002": (HEAD + "param x = 1 2\n", "The parser found a token it cannot use here; the message lists what it expected. "
                                     "Common mistakes (missing braces, arrows, `<=`, unknown words) have their own "
                                     "codes below. A name close to a keyword expected there gets a \"did you "
                                     "mean\" (`partiton`, or `paralel {` and `lop` in a walk), and a loop without "
                                     "`max=`, a node or walk statement between declarations and a `...` copied "
                                     "from the docs each get a message of their own."),
 "MW003": (HEAD + "param x =", "The file ends in the middle of a declaration."),
 "MW004": (HEAD + "walk w\n    LLM(text_inputs)\n}\n", "A `node`, `walk`, `parallel`, `sequential`, `loop` or "
                                                       "`combine` header must be followed by `{`."),
 "MW005": (HEAD + NODE % "    combine mixed = prefill + decode {\n        rows prefill = 4\n    }\n",
     "A rows limit bounds the rows of one walk in a mixed step and is written `rows WALK <= N`."),
 "MW006": (HEAD + "walk w {\n    LLM(text_inputs) new_token: client text\n}\n",
     "Every output edge of a call starts with `->`."),
 "MW007": (HEAD + "node LLM kvcache(layers=2) {\n    in text_inputs\n}\n",
     "A node's engine is `kv` (paged KV cache) or `stateless`."),
 "MW008": (HEAD + NODE % "    cap decode\n", "`cap WALK N` in a node, `cap N` in a combine: the number of rows is "
                                             "required."),
 "MW009": (HEAD + "walk w {\n    loop max=4 {\n        LLM(text_inputs)\n}\n",
     "A block is still open when the declaration (or the file) ends; the note shows where it was opened."),
 "MW010": (HEAD + "walk w {\n    loop(x) -> y: client text\n}\n",
     "A keyword is read as a plain name wherever only a name can stand (a node or walk named `stream` is "
     "fine), but not where the keyword itself may start something: a node named `loop` cannot be called in a "
     "walk, where `loop` starts a loop (docs/language.md). Avoid keywords as names."),
 "MW011": ("param x = 1\nmodel m\n", "A spec starts with exactly one `model NAME` line."),
 "MW012": (HEAD + NODE % "    capture decode bucketed batch=[1, 2]\n",
     "A capture family is `batched` (fixed tokens per row) or `packed` (batch x token buckets)."),
 "MW013": (HEAD + NODE % "    combine mixed = prefill + decode {\n        attention fused\n    }\n",
     "A combined walk's attention route is `split` or `packed`."),
 "MW014": (HEAD + "partition S = chunk <- P.x sliding(28, stride=7)\n",
     "A stream is cut by `window(SIZE, stride=N)`, `left_context(chunk=N, context=M)` or `fixed(SIZE[, "
     "continue_after_done])`."),
 "MW015": (HEAD + "walk w {\n    LLM(text_inputs) -> new_token: client text persistent\n}\n",
     "Edge flags are `persist`, `stream`, `device` and `count_tokens`; a client edge names one modality."),
 "MW016": (HEAD + NODE % "    state conv(layers=2)\n", "The only state kind besides the KV cache is `recurrent`."),
 "MW017": (HEAD + "walk w {\n    LLM(text_inputs) -> new_token: client\n}\n",
     "A client edge names what it carries: `-> NAME: client MODALITY`."),
 "MW018": (HEAD + "node LLM kv(layers=2) {\n    in text_inputs: token prompt text\n}\n",
     "A role, a prompt or client modality, or a stateless node's model kind is one of the words listed in the message "
     "(docs/language.md \"Roles\")."),
 "MW020": (HEAD + NODE % "    combine mixed = prefill + decode {\n        cap 8\n        cap 16\n    }\n",
     "A setting that fills one field (a combine's `cap`, `capture`, `attention`, a node's `kv_sequences`, ...) may be "
     "given once."),
 "MW021": (HEAD + NODE % "    capture decode batched tokens_per_row=2\n",
     "Every capture lists its batch sizes with `batch=[...]`."),
 "MW022": (HEAD + "param x = 99999999999999999999999\n", "Numbers must fit a signed 64-bit integer."),
 "MW023": (HEAD + 'node LLM kv(name="a\\q") {\n    in text_inputs\n}\n',
           "Quoted strings use JSON escapes. A surrogate escape must come with its other half "
              "(`\\ud83d\\ude00` is one character); one alone (`\"\\ud800\"`) is not a character and is refused too "
              "(`mstarc check` took it and `mstarc compile` failed with an internal error)."),
}
lang_no_example = {"MW024": "Blocks nested more than 100 deep; every pass walks the tree recursively.", "MW099":
    "An unexpected failure inside the parser. This is a bug in mstar, never a problem of the input: please report it "
    "with the spec that caused it."}

explain = {
 "MW101": "A call or an edge names a node that no `node` declares. Edge destinations are a node, `conductor` or "
          "`client MODALITY`.",
 "MW102": "A call passes, or an edge delivers, a name that is not one of the node's `in` declarations. The reference "
          "asserts the same at run time (an edge name must be a declared input of its node).",
 "MW103": "A `cap`, `capture`, `combine`, `rows` limit or partition stage names a walk that no `walk` declares.",
 "MW104": "A loop bound `max=NAME` names no `param`.",
 "MW105": "A stream source `<- PARTITION.EDGE` names no partition.",
 "MW106": "A stream source names an edge that no walk of the producer partition sends with the `stream` flag.",
 "MW107": "Params, nodes, walks and partitions each have their own namespace, in which a name is declared once; so are "
          "a node's inputs, caps, capture replays and combined walks, and the named loops of a walk. (A walk may "
          "have several `capture` lines: MW414.)",
 "MW108": "`conductor` and `client` are edge destinations, so no node may take either name.",
 "MW109": "A node's header (or its `state recurrent(...)`) gives an argument the runtime does not read for that "
          "engine. Without this check a typo such as `kv_head=8` would silently fall back to a default. The known "
          "names are listed in the note and in docs/language.md (Node arguments); an argument given twice is MW107.",
 "MW110": "An argument's value is of the wrong kind: counts and sizes are positive integers, `rope_theta` a positive "
          "number, `partial_rotary` a fraction, `style` one of its names, `layer_pattern` a list of 0/1, `stop_tokens` "
          "a list of token ids.",
 "MW111": "`state recurrent(...)` sizes one slot per live request from all four of `layers`, `heads`, `key_dim` and "
          "`value_dim`; none has a default.",
 "MW113": "A stateless node says what model it is after `stateless`: `audio_codec` (codes in, audio out), "
          "`image_decoder` (flow latents in, an image out), `vision_encoder` or `audio_encoder` (media in, embeddings "
          "out). A decoder is not a stateless kind: a decoder is a `kv` node (`node NAME kv(...)`). The runtime builds "
          "that model; it never guesses from names or edges.",
 "MW114": "Every input states what it takes (`in NAME: ROLE`): `tokens`, `embeddings`, `hidden`, `mask`, "
          "`flow_latents`, `flow_time`, `media` or `signal`. The runtime reads the role, never the name.",
 "MW115": "An edge carries one of its node's declared outputs (`out NAME: ROLE`), by name; the role says what the "
          "value is (sampled tokens, hidden states, media, ...).",
 "MW116": "The walks a request may start a partition with (up to its first stage that is not optional; partitions fed "
          "by streams excepted) must call an input that takes the request's prompt: `in NAME: tokens prompt text`, or "
          "`media prompt image|audio`.",
 "MW117": "An edge's output role must fit the destination input's role: tokens and transcripts feed `tokens`; "
          "embeddings, hidden states and velocities feed `embeddings` or `hidden`; masks `mask`; flow latents and "
          "time `flow_latents` / `flow_time`; audio and images `media`; a `signal` output feeds only a `signal` "
          "input. A `signal` input takes anything.",
 "MW118": "`client text` carries `tokens` or a `transcript` output, `client audio` an `audio` output, "
          "`client image` an `image` output, "
          "`client action` a `flow_latents` output (a flow's final latents: a robot's action chunk) and `client "
          "latents` a `hidden` or `embeddings` output (representations as floats: V-JEPA 2's predictions).",
 "MW119": "A prompt goes to an input that can take it: not a stream input (its values come from the stream), `tokens` "
          "for a text prompt and `media` for an image or audio prompt, and one input per modality on a node.",
 "MW120": "`guidance LABEL ...` and `kv WALK reads/writes ...` name sequences of the node's `kv_sequences`; a guidance "
          "label is not the first sequence, which holds the whole prompt.",
 "MW121": "On a kv node with several KV sequences or a `cross_kv` pool every walk that calls it says which it reads "
          "or writes (`kv WALK writes main cfg_img`), naming every cross_kv pool of the node (its layers cross-attend "
          "in every call); an image-flow walk only `reads`. Any other walk `writes`, or only `reads`: a read-only KV "
          "walk attends over the sequences without extending them.",
 "MW122": "What a node of each kind takes and produces: a decoder (every kv node) takes tokens, embeddings, hidden "
          "states, masks, flow latents and time and produces tokens, embeddings, hidden states, masks, velocities and "
          "flow latents and time; an `audio_codec` takes tokens and produces `audio`; an `image_decoder` takes "
          "`flow_latents` and produces an `image`; encoders take `media` and produce embeddings or hidden states. Any "
          "node may take a `signal`.",
 "MW123": "A node's dims are past what the runtime can allocate: `layers` above 4096, any count or size above 2**31 - "
          "1 (int32 on the device), or weights and recurrent state whose lower-bound estimate (bf16 embeddings, "
          "attention and MLP projections) passes 2 TiB per node. The message gives the memory the dims imply. Checked "
          "before anything is built per layer, so `layers=1000000000` is an error in milliseconds instead of minutes "
          "and gigabytes; docs/limits.md lists every bound.",
 "MW124": "A sub-model (`submodel NAME(ARGS) for WALK ...`) runs a walk's rows on other weights over the same KV "
          "cache, so it belongs to a kv node (not a Whisper-style decoder, which runs one model), a walk runs on at "
          "most one sub-model of a node, and its query heads are a multiple of the node's KV heads. Its arguments "
          "are widths only (hidden, intermediate, qo_heads, vocab, latent_channels, latent_tokens; another is "
          "MW109): layers, KV heads and head size stay the node's (a depth model, `samples OUTPUT depth=N`, has "
          "its own: MW125). docs/language.md \"Sub-models\".",
 "MW125": "A depth model (`submodel NAME(ARGS) samples OUTPUT depth=N for WALK ...`, Qwen3-TTS's code predictor) "
          "runs after the node's model and extends the token it sampled for OUTPUT by N more, so OUTPUT is a "
          "declared `tokens` output of the node, N is 1 to 4096 (the runtime builds an embedding and a head per "
          "position), every walk it lists emits OUTPUT from the node's "
          "call and runs the node's own model (not a sub-model), a walk has one depth model per output, and "
          "where OUTPUT feeds an audio codec with `quantizers=Q` "
          "the frame it makes holds Q codes (N + 1 = Q). docs/language.md \"Depth models\".",
 "MW126": "A warning: the output a depth model extends counts toward the request's output tokens (an edge with "
          "`count_tokens`, or a `client text` edge, which a partition without `count_tokens` counts), N + 1 a "
          "frame, while the engines reserve and check `prompt + max_tokens` KV positions on the node, one a "
          "frame: each request reserves N + 1 times the pages its frames need and a long one is refused as past "
          "`max_seq_len`. Count nothing there (`specs/qwen3_tts.mw`): `max_tokens` then bounds the frames and a "
          "request it cuts ends `length`. docs/language.md \"Depth models\".",
 "MW130": "A `cross_kv LABEL from INPUT tokens=N` pool belongs on a kv node whose decoder style has cross-attention "
          "layers (`style=whisper`), is filled from an input that carries another model's states (`hidden` or "
          "`embeddings`, not a stream input or the prompt) and holds at least one token. A `whisper` decoder without a "
          "pool is reported too: it cross-attends in every layer.",
 "MW131": "Some walk must fill each cross_kv pool: `kv WALK writes ... LABEL` for the walk whose call of the node "
          "passes the pool's input (Whisper's prefill, which takes the encoder's states).",
 "MW132": "A walk fills a pool exactly when its call of the node takes the pool's input: a walk that writes the pool "
          "without passing the input has nothing to fill it with, and one that passes the input without writing the "
          "pool would drop the states (they never enter a self-attention sequence).",
 "MW133": "A walk that only reads a pool runs after a walk that fills it: some filling walk sits at an earlier stage "
          "of the reading walk's partition (for walks no partition lists, earlier in declaration order).",
 "MW140": "A node's `prompt_format` must be able to frame a text prompt: it sits on the node whose input takes the "
          "text prompt, its template has a `{prompt}` field and otherwise only plain named fields (`{voice}`; no "
          "positional, dotted or formatted ones), `before` and `after` are token lists inside the node's vocabulary, "
          "each default is text for a field of the template, and no field but `{prompt}` is named like a request's "
          "own field (`seed`, `max_tokens`, `route`, the speech body's `model`...: `mstar/plan/request_fields.py`; a "
          "request's `seed` would be read both ways). docs/language.md \"Prompt formats\".",
 "MW141": "A stream's `keep LOW..HIGH` drops the items outside the range before the stream is cut into chunks; the "
          "range must keep something (LOW <= HIGH, and LOW below the producing node's `vocab`: with no token "
          "passing, the consumer never gets a chunk and the media it makes never come) and the stream must carry "
          "tokens, since items are compared as token ids. docs/language.md \"Partitions\".",
 "MW112": "The arguments are each valid but together describe no model the runtime can build: query heads that are not "
          "a multiple of KV heads, linear value heads not a multiple of the linear q/k heads, a recurrent state whose "
          "layer count differs from the linear-attention layers of the layer pattern (or linear layers without a "
          "recurrent state), state on a stateless node, a stop token outside the vocabulary, `hidden` not a multiple "
          "of `heads`, a non-square `latent_tokens`, an odd `head_dim` (a kv node's or a depth model's: RoPE rotates a "
          "head's dims in pairs).",
 "MW201": "Where an input may come from: an earlier edge of the same walk (or a parallel sibling); a stream, when the "
          "input is declared `in NAME stream` and the walk's partition has a stream source `<- P.NAME`; or the "
          "conductor, which feeds every input of a walk's entry calls (calls no edge of the walk reaches), any request "
          "input (an input of an entry call of a walk of the partition) or persisted edge (`-> x: conductor persist`), "
          "and any input that no edge of the spec delivers to that node (request data). A request never brings "
          "`hidden` or `embeddings` values, so such an input that no edge of the walk carries and no walk persists is "
          "reported where it is taken, with the call that makes the value but has no edge for it (a deleted encoder "
          "edge) and a persisted name it may be misspelt as; a loop-back does not feed its loop's first iteration. "
          "Otherwise MW201 means the model computes the input elsewhere but nothing brings it to this call, or a "
          "stream input has no stream source. An input fed by an edge going backwards outside a loop is MW202's, "
          "not MW201's.",
 "MW202": "An edge that goes back to a call that ran earlier is a loop-back only when a loop encloses both calls (as "
          "the reference derives loop-backs). Outside a loop the target would wait forever. Parallel siblings that "
          "feed each other in a cycle are reported too.",
 "MW203": "A loop's `outputs` and `accumulate` names are matched by name to edges produced inside the loop; a name "
          "nothing inside produces would be silently dropped by the reference.",
 "MW204": "A name is either the final value of the loop (`outputs`) or the per-iteration list (`accumulate`), never "
          "both (the reference raises ValueError).",
 "MW205": "A plain edge to a node must reach a call of that node in the same walk that takes the edge's name. Edges to "
          "another partition are stream edges.",
 "MW206": "`device` keeps a value on the device between iterations; only a loop-back edge to the same node can do "
          "that.",
 "MW207": "A route names the walks a request takes through a partition, and each stage takes the alternative whose "
          "walks come next in it; two alternatives of one stage that start with the same walk would make that "
          "ambiguous. (A walk may appear again in a later stage, or inside an alternative's sequence.)",
 "MW208": "Partitions that stream to each other in a cycle cannot start: each would wait for the other.",
 "MW209": "Every walk belongs to exactly one partition, whose walk order says when a request runs it.",
 "MW210": "A stream edge, the consumer's `in NAME stream` declaration and the consumer partition's `<- PRODUCER.NAME` "
          "source must agree: the edge needs a partition that takes it and runs the target node on it, the target "
          "input must be declared `stream`, and a stream source needs a walk whose node has that stream input.",
 "MW211": "A walk, loop, parallel or sequential section with nothing in it, or a partition that runs no walk.",
 "MW212": "A loop runs at least once: its bound (a number or a param's value) must be at least 1.",
 "MW215": "A loop written `count=PARAM` runs, for each request, the request's own count of that name (its "
          "`loop_counts`), else the param's value; either must be at least 1 and at most the loop's `max`, so the "
          "default is checked here and a request's own count when it is admitted (the request fails alone, "
          "docs/runtime.md).",
 "MW216": "A partition's `repeat while VALUE max=N` runs its stages again while the partition's persisted value "
          "VALUE is above zero, so some walk of the partition must persist it (`-> VALUE: conductor persist`); the "
          "bound counts every round, the first included, so it is at least 1.",
 "MW217": "A stream source's policy cuts chunks of at least one item: `window(SIZE, ...)`, "
          "`left_context(chunk=C, ...)` and `fixed(SIZE)` need SIZE (C) of 1 or more, or the consumer partition "
          "would never get a chunk to run (`load_plan` refuses a plan with such a stream). A window's `stride`, "
          "when given, is at least 1 too: left out, the window moves by its size. No size, stride or context passes "
          "2**20 items, the most tokens a step holds (a chunk is one step's input of its consumer, and the codec "
          "runners pad the last chunk to the window's size).",
 "MW434": "Each item of a stream chunk is a position the consumer's row feeds, so a stream into a kv node whose "
          "chunks hold more items (a `fixed` or `window` size, a `left_context` chunk plus its context) than a "
          "batched capture of a walk taking them holds tokens a row makes every such step one its capture cannot "
          "replay (the engines refused each at run time: `StepContractError: ... feeds 2 tokens, past the 1 "
          "tokens a row of batched capture ...`). Cut smaller chunks, or capture the walk with `tokens_per_row` "
          "of at least the chunk's items (or packed).",
 "MW435": "A warning: a walk whose calls of a kv node, outside loops, take the request's text prompt feeds a whole "
          "prompt (or a chunk of one) a row, any number of tokens, while a batched capture holds `tokens_per_row` "
          "tokens a row. The runtime runs each step with a longer row eagerly (the scheduler padded such steps to "
          "the batched family before, and the engines refused every one: `StepContractError: ... feeds 20 tokens, "
          "past the 1 tokens a row of batched capture LLM:prefill`, 20 of 20 requests failed). Capture the walk "
          "packed, with token buckets, to replay its prompt steps. A capture with `unroll_prompts=N` is left "
          "alone: its author replays prompt rows of at most N tokens as one-token rows.",
 "MW436": "A warning: a combined walk without a `cap` of its own takes, in a mixed step, the smallest cap of its "
          "walks, so where those differ a step holding one row of the small-cap walk (a prompt) holds fewer rows of "
          "the other (decode) than that walk takes alone: the cap throttles decode whenever a prompt is in the step "
          "(on the simulated engine, 200 requests at 64 clients: 11% less throughput, p90 inter-token time 1.68 -> "
          "2.55 ms). Give the block a `cap` (the larger walk's) and a `rows` limit for the prompt walk.",
 "MW218": "A `continue_after_done` stream never ends: once drained it answers each ask for a chunk with an empty "
          "one, for consumers whose stages each run once (Qwen3-Omni's Talker). A partition fed by streams whose "
          "route can be a single walk re-runs that walk per chunk until its streams end (SNAC, Code2Wav), so such a "
          "stream into it would run every request for ever (the run spun at full CPU and no request ended).",
 "MW214": "The maximum iterations of nested loops multiply into the steps one request may take in a walk (twenty "
          "nested `loop max=3` is 3**20, about 3.5 billion). Past 2**30 the walk is refused, at the innermost loop "
          "where the product passes the limit, with the enclosing loops as notes.",
 "MW213": "The early-stop check names the loop it ends, so `stop` needs a named loop.",
 "MW301": "The deployment file is missing, is a directory, is not a regular file (a FIFO or `/dev/zero`), is larger "
          "than 1 MiB (docs/limits.md), or is not UTF-8 text.",
 "MW302": "The deployment file is not valid YAML; the position is where the YAML parser gave up. Also: values nested "
          "more than 64 levels deep, or more than 100,000 values once YAML aliases are expanded (a \"billion laughs\" "
          "file, measured on the composed graph without expanding it); docs/limits.md.",
 "MW303": "A key that neither the reference system's serving YAML nor mstar's own keys define. The suggestion is the "
          "closest known key of the same mapping.",
 "MW304": "A value of the wrong type or range (strict: `tp_size: \"2\"` is a string, not a number), a key given twice, "
          "a non-string key, or a YAML tag mstar does not read. Anywhere in the file (`model_kwargs` too): a number "
          "that is not finite (`.nan`, `.inf`), an integer outside int64, a string with an unpaired surrogate, a date "
          "or binary value; KV pool sizes past 2**31 - 1 pages or 2**20 tokens a page.",
 "MW305": "`model`, `max_seq_len` and `node_groups` (and `node_names` and `ranks` in each group) are required, as in "
          "the reference.",
 "MW310": "Every (node, walk) a walk runs must be placed by a node group: a group lists the node and either has no "
          "`graph_walks` or lists the walk.",
 "MW311": "Two node groups place the same (node, walk): the reference's routing would keep only the last. "
          "Data-parallel replicas are extra ranks in one group.",
 "MW312": "A group's explicit `graph_walks` (or a `speculation_mixes_walks` entry `NODE.WALK`) names a walk its nodes "
          "do not run.",
 "MW313": "`node_names`, `kv_pool.nodes`, `kv_cache.nodes` or `speculation_mixes_walks` names a node the spec does not "
          "declare.",
 "MW314": "`graph_walks` or `speculation_mixes_walks` names a walk the spec does not declare.",
 "MW315": "A group's ranks form instances of tp_size x sp_size ranks each (extra instances are data-parallel "
          "replicas), so their number is a multiple of it (asserted by the reference).",
 "MW316": "Only nodes marked `tp` may be sharded (the reference raises ValueError). The language has one marker for "
          "lockstep sharding, so sp_size > 1 needs `tp` as well.",
 "MW317": "A worker hosts at most one lockstep (tp_size x sp_size > 1) node (NotImplementedError in the reference).",
 "MW318": "A node that consumes a stream keeps one stream buffer per request on its worker, so all its walks run on "
          "the same ranks, and a lockstep stream consumer may not restrict its group to some walks (the reference's "
          "`assert_stream_consumer_compatibility`).",
 "MW319": "The deployment's `model` must be the spec's `model`.",
 "MW320": "A rank appears twice in one group's `ranks`.",
 "MW321": "A kv node's KV cache moves between its walks (prefill to decode); the reference rejects transfers between "
          "different TP world sizes, so a PD split needs equal TP on both sides.",
 "MW323": "A kv node's pool (pages x page size x the node's layers, KV heads and head dim, keys and values in bf16) "
          "takes more than 2 TiB, more than the runtime can allocate; `num_pages` is also bounded by 2**31 - 1 and "
          "`page_size` by 2**20 (MW304). The same bound holds for its KV offload host pool (`cpu_offload_pages` "
          "pages of the same size, in host memory; at most 2**31 - 1 pages, MW304) and for its recurrent state "
          "(`recurrent_state_slots` slots of layers x heads x key_dim x value_dim fp32 values).",
 "MW324": "The ranks the node groups use must be 0 to N-1 with none skipped: the runtime's world is the highest rank "
          "plus one, a process each, so `ranks: [15]` on a one-GPU deployment started 15 processes with nothing to "
          "do. A rank is also at most 1023 (MW304).",
 "MW325": "Each request holds one recurrent state slot of a node with `state recurrent(...)` from its first step to "
          "its end, so `recurrent_state_slots` must be at least `max_concurrent_requests` (the runtime refuses to "
          "start otherwise). Left out, it defaults to `max_concurrent_requests`.",
 "MW326": "A kv node run tensor-parallel is sharded over its `tp_size` ranks: each rank takes whole query heads "
          "(`qo_heads` a multiple of `tp_size`), whole kv heads (`kv_heads` a multiple of `tp_size`, or dividing it: "
          "each kv head then replicated), an equal part of the MLP (`intermediate`) and of the gated delta-net heads. "
          "The check reads the node's dims as `--dims spec` builds them (their defaults included); the runtime "
          "refused such a split only at start-up. A node's sub-models are sharded with it, so their widths must "
          "split too, and a depth model does not run tensor-parallel (each passed mstarc and failed at start-up).",
 "MW327": "`sp_size` above 1 asks for the reference's sequence parallelism, which mstar's engines do not run: the "
          "simulated engine ran such a plan and every engine refused it at start-up (`sequence parallelism "
          "(sp_size=2) is not supported`). Shard the node with `tp_size`, or list its ranks as data-parallel "
          "replicas.",
 "MW322": "A kv node's pool (`kv_pool`, its per-node override, else `kv_cache`, else 2048 pages of 128 tokens) must "
          "hold at least one request of the pool's `max_seq_len` tokens (`kv_cache.max_seq_len` when given, else "
          "`max_seq_len`).",
 "MW401": "A combined walk batches rows of several walks of one node; every walk it names must run that node. Likewise "
          "a node's `cap`, `capture` and `bidirectional` lines are for walks that run it.",
 "MW402": "A walk belongs to at most one combined walk of a node: its rows get one scheduling key.",
 "MW403": "Capture-key split: the combined walk's walks fall in different capture families (eager, batched with N "
          "tokens a row, packed) and the combined walk has no capture of its own, so no single CUDA graph could replay "
          "a mixed step. Give the combined walk a `capture` (usually packed).",
 "MW404": "On each worker, the walks of a combined walk that this worker runs share one node group (TP group), or all "
          "run at world size 1: a mixed step is one lockstep launch. Walks the worker does not run are not judged, so "
          "prefill/decode disaggregation needs no change to the spec.",
 "MW405": "A cap above the largest captured batch size means steps of more rows than any graph holds: they run "
          "eagerly. Raise the capture's batch sizes or lower the cap, or say that such steps run eagerly by intent "
          "with `eager_above` after the capture. (A walk without a capture runs eagerly by design "
          "and is not reported; with no `cap` a walk's largest captured batch is its cap. A combined walk's mixed "
          "steps are checked against its own capture: its `cap`, else the largest a mixed step can take by the plan's "
          "rule, the smallest cap of the walks in the step (docs/plan.md), reported at the capture.)",
 "MW406": "A rows limit above the largest batch size of the combined walk's packed capture could never be reached by a "
          "replayed step.",
 "MW407": "A rows limit bounds one of the combined walk's own walks.",
 "MW408": "The estimated capture memory (capture_memory.py, modelled on the GPU engine's graphs and within 25% "
          "of the growth measured at capture on an H200 for the Llama decode family: each graph's logits and "
          "outputs, the activations and bf16 logits of the largest bucket (and a gated delta-net node's rule "
          "scratch in one layer; its states are read in their slots, not copied) shared through the pool, "
          "divided by TP, "
          "plus the capture stream's cuBLAS workspace) of all capture families on one worker exceeds "
          "`capture_memory_budget_mb`: the families its plan holds (a combined walk's only where the worker runs "
          "two of its walks, not on the ranks of a prefill/decode split). The message lists every family with its "
          "bucket count: a wider capture set (the reference once grew a node's buckets from 29 to 68 and failed to "
          "boot) shows up here at compile time. Without `capture_memory_budget_mb` (at most 2,097,152, 2 TiB) the "
          "bound is 2 TiB, what the runtime can allocate.",
 "MW409": "A combined walk needs at least two distinct walks.",
 "MW411": "Caps and captured batch sizes are at most 65,536 rows, a step at most 2**20 tokens (token buckets, or "
          "tokens per row x batch size), a capture family at most 4,096 graphs (batch sizes x token buckets) and a "
          "combined walk at most 12 walks (the plan lists each of the 2**n mixtures). The plan's lookup tables are "
          "sized by these numbers, so without the bound `batch=[100000000]` took a minute and gigabytes to lower; "
          "docs/limits.md.",
 "MW412": "A batching rule (`batching WALK same shape, iteration, guidance`) must be able to tell rows apart: "
          "`iteration` needs the node's call inside a loop of the walk, `guidance` a node with guidance sequences; "
          "a walk has one `batching` line per node; and a walk with rules is in no combined walk of the node, since "
          "a step of it holds only rows of that walk and equal class (docs/language.md \"Batching rules\").",
 "MW413": "`piecewise` captures each step as pieces split at the attention layers and runs attention eagerly "
          "between them. A node whose network has no attention layers (an `audio_codec`, as in the reference, whose "
          "audio-codec flavor has no piecewise runner) has nothing to leave out: capture it whole.",
 "MW414": "A walk may have several captures (per-shape buckets: the step takes the family whose key holds it with "
          "the smallest tokens, then batch). Two of them that are one family written twice (same kind, options and "
          "guidance mode, and the same tokens per row, batched, or the same batch sizes or token buckets, "
          "packed) capture exactly what one line with both lists would: write that line.",
 "MW415": "`capture W replays S` makes one-walk steps of W replay the captures of S (the reference's "
          "replay_graph_walks). S must have a `capture` line of its own on the node; a walk that only replays "
          "cannot be replayed in turn (name the walk that captures), and a walk does not replay itself.",
 "MW416": "A captured graph bakes in what a step computes: the attention kernels (decode kernels for one token a "
          "row, prefill kernels otherwise), the attention mask (`bidirectional`), the model (`submodel`) and the KV "
          "sequences read and written (`kv` lines). A walk replays only the captures of a walk that agrees on all "
          "four.",
 "MW417": "A capture's `labels=[...]` name the KV sequences its graphs touch: each must be one of the node's "
          "`kv_sequences` (or a `cross_kv` pool), once. A stateless node has no KV sequences, so a label there is "
          "always this error.",
 "MW418": "A `guided` capture serves only steps that hold a request requiring guidance on the node (a guidance "
          "scale above 1 and a route through a walk that reads a guidance sequence). A node without `guidance` "
          "sequences never has such a step, so the family would be captured and never replayed.",
 "MW419": "A captured graph runs the KV sequences baked into it, so a capture's sequences must be exactly those "
          "its steps touch: a walk's rows touch its `kv` line's sequences, but an unguided request keeps only the "
          "non-guidance ones. An `unguided` capture's labels cannot include a guidance sequence; labels that add or "
          "leave out one of the sequences the steps of the capture's mode touch are refused; and a capture without "
          "`guided` / `unguided` serves steps of both modes, which is refused when guided steps touch other "
          "sequences than unguided ones (write a line for each mode, as BAGEL's decode does).",
 "MW425": "The key of a capture is its walk, its guidance mode and its buckets. A capture without a mode serves "
          "steps of both modes, so beside a `guided` (or `unguided`) capture that is otherwise the same family "
          "(MW414's rule) a step of that mode could replay either, with equal keys: state a mode on both (they "
          "are then apart, or MW414 asks for one line), or on neither.",
 "MW426": "`unroll_prompts=N` lets a step whose prompt rows hold at most N tokens each replay a batched family "
          "with one row per query token, each row reading its own length of the KV cache and writing its token's "
          "K/V before any row of the layer attends. That needs one-token rows (a batched family of one token a "
          "row), a KV cache, no recurrent state (a recurrent state moves one token after another, while the rows "
          "of a step run side by side), and room for N rows in the family's largest batch.",
 "MW410": "A mixed step runs its rows through one packed attention call, and such a call has one mask: causal (text "
          "prefill, decode) or bidirectional within each row's own tokens (the walks a node lists in `bidirectional`, "
          "such as BAGEL's image prefills). A combined walk must therefore be all causal or all bidirectional.",
 "MW420": "A kv node's prefill chunk size (`max_prefill_chunk_size` with `scheduler_owns_chunking: true`, or "
          "`kv_pool.nodes.NODE.max_prefill_chunk_size`) must fit in its step token budget (`max_step_tokens`, or "
          "`kv_pool.nodes.NODE.max_step_tokens`): the scheduler cuts a prompt into chunks that fit a step beside its "
          "decode rows, so a chunk above the budget could never be fed whole.",
 "MW421": "Rows of a walk whose node runs inside a loop (a decode iteration) are never cut: a full step of them, the "
          "walk's cap (or a combined walk's larger cap less the one row of another walk that makes its step mixed) "
          "times its tokens a row, must fit the step token "
          "budget, or decode rows alone would break it; when the node's prompts are cut it must also leave at least "
          "one token of the budget, or a prompt could wait behind full decode steps for ever. Only where such rows "
          "may share a key with prompt rows (a combined walk): a key of loop rows alone carries no budget "
          "(docs/plan.md, `token_budget`), so Cosmos 3's image_gen, 8 rows of 1,560 latent tokens a step, takes a "
          "budget sized for prompt chunks.",
 "MW422": "Steps that hold prompt chunks are packed: when the budget is set, the fullest of them hold the whole "
          "budget, so every packed capture such a step replays (the chunked walk's own, its combined walk's) needs a "
          "token bucket of at least the budget; without a budget, one that holds a chunk. Otherwise those steps, the "
          "common ones under load, run eagerly.",
 "MW423": "A warning: the reference's `max_prefill_chunk_size` is read only with `scheduler_owns_chunking: true`, "
          "because mstar cuts prompts in the scheduler and nowhere else; without it prompts run whole (the step token "
          "budget still applies). `kv_pool.nodes.NODE.max_prefill_chunk_size` always chunks.",
 "MW427": "A warning: a node with recurrent state (gated delta-net layers) runs its layers' conv and chunked rule "
          "with grids and gather indices taken from each step's row lengths, which a whole packed graph would fix at "
          "capture; the runtime runs such a family's steps eagerly. With `piecewise` the graphs hold everything "
          "around those layers (norms, projections, gates, MLPs, the sampling head), and the layers' middles run "
          "between the pieces, as attention does.",
 "MW429": "A warning: a prefix cache skips computing a cached prefix's positions, so a walk can start after one "
          "only when nothing it sends holds a value per prompt position. A walk that takes the node's text prompt but "
          "sends hidden states that do not loop back into the node, or a mask (Qwen3-Omni's Thinker streams its "
          "states to the Talker), would send nothing for the cached positions; it is left out of the plan's "
          "`prefix_walks`, and its prompts are computed whole. (Cut into chunks, such a walk sends every "
          "chunk's states with its last chunk.)",
 "MW428": "A warning: a prefix cache shares full KV pages by their token ids, but the self-attention K/V of a node "
          "that cross-attends (a `cross_kv` pool: a Whisper decoder over the audio) depend, from its second layer "
          "on, on what it cross-attends as well as on its tokens, so two requests with the same leading tokens and "
          "other audio must not share them. The plan says `prefix_cache: cross_attention` for that node and the "
          "runtime keeps the cache off there.",
 "MW431": "A warning: a prefix cache lets a request's first row start after the longest cached prefix of its "
          "prompt, which only a walk that takes the node's text prompt and can be cut into chunks allows (a "
          "cached prefix is a chunk already fed): not a call inside a loop, a bidirectional walk or a walk with "
          "batching rules. When no walk of the node qualifies, the plan's `prefix_walks` is empty and nothing is "
          "ever looked up: the switch does nothing. Given per node (`kv_pool.nodes.NODE.prefix_cache`) it is "
          "warned for that node; the deployment-wide `prefix_cache: true` only when it serves no kv node at all "
          "(a multi-node model's other nodes are expected to go without).",
 "MW430": "A warning: KV offload moves the paged KV of started requests that wait to a host pool, but a node that "
          "cross-attends (a `cross_kv` pool: a Whisper decoder) keeps each request's KV outside the paged pool (its "
          "runner decodes one request at a time, as the reference's), so nothing of it can move. The plan says "
          "`host_pages: 0` for that node; other nodes of the deployment keep their host pool.",
 "MW432": "A step holds at least one row: `cap WALK N`, a combined walk's `cap N` and `rows WALK <= N` need N of "
          "1 or more. A cap of 0 would let no step of the walk (or no mixed step) run, and a rows limit of 0 keeps "
          "the walk out of every mixed step, which is what leaving it out of the combined walk says; `load_plan` "
          "refuses a plan with a cap or a rows limit below 1. Leave a cap out to take the default (the walk's "
          "largest captured batch size; for a mixed step the smallest cap of the walks in it).",
 "MW433": "A capture's graphs are keyed by its batch sizes (and, packed, its token buckets), so `batch=[...]` lists "
          "at least one size, each at least 1 and listed once, and a packed capture lists its token buckets the "
          "same way in `tokens=[...]` (which it cannot leave out). A batched capture's tokens are its batch sizes x "
          "`tokens_per_row` (at least 1), so it takes no `tokens=` list. `load_plan` refuses a plan whose batch "
          "sizes or token buckets are empty, hold 0 or repeat; the order of a list does not matter (it is sorted). "
          "Checked first among the capture checks (with MW411), which read a capture's largest batch size.",
 "MW424": "A warning: a prefix cache shares full KV pages between requests with the same leading tokens, but a node "
          "with recurrent state (gated delta-net layers) also needs the state after the prefix, which no KV page "
          "holds. The plan says `prefix_cache: recurrent_state` for that node and the runtime keeps the cache off "
          "there.",
}

def lang_example(code: str) -> str:
    text, _ = lang_cases[code]
    diags = Diagnostics()
    parse(text, "example.mw", diags)
    out = diags.render()
    if f"[{code}]" not in out:
        raise SystemExit(f"the example of {code} now reports something else:\n{out}")
    return out

def check_example(code: str) -> tuple[list[str], str]:
    names = sorted(p.stem for p in FIXTURES.glob(f"{code}_*.expected"))
    out = "\n".join(render_fixture(n) for n in names)
    return names, out


def build() -> str:
    lines = []
    w = lines.append
    w("# Diagnostics\n")
    w("Every diagnostic mstar prints has a code, a message, the file, line and column it is about, the")
    w("source line with an underline, and notes pointing at related places:\n")
    w("```\nfile:line:col: error[MWnnn]: message\n   nn | source line\n      |     ^^^^^^\nfile:line:col: note: "
      "secondary message\n```\n")
    w("All diagnostics of a run are collected and printed together, sorted by file and position; the")
    w("compiler stops after the first pass that reported an error. Exit status: 0 no error, 1 errors in")
    w("the input, 2 usage. No input file, however broken, produces a Python traceback: that would be a bug.\n")
    w("| range | pass | registry |\n|---|---|---|")
    w("| MW001-MW099 | parse (`mstar.lang.parser`) | `mstar/lang/codes.py` |")
    w("| MW101-MW199 | resolve: names to declarations | `mstar/compiler/codes.py` |")
    w("| MW201-MW299 | check_graph: walks, loops, partitions, streams | `mstar/compiler/codes.py` |")
    w("| MW301-MW309 | reading the deployment YAML | `mstar/compiler/codes.py` |")
    w("| MW310-MW399 | check_deployment: placement and sharding | `mstar/compiler/codes.py` |")
    w("| MW401-MW499 | check_combine: combined walks, caps, captures, capture memory | `mstar/compiler/codes.py` |")
    w("| MW500-MW501 | the compiler driver: input files, output sizes | `mstar/compiler/driver.py` |\n")
    w("Examples of MW1xx-MW4xx are the golden fixtures in `tests/checks/fixtures/` (a `.mw` spec, a")
    w("`.yaml` deployment, or both; deployment fixtures without a spec of their own are checked against")
    w("`fixtures/base.mw`), printed exactly as the tests expect.\n")

    w("## Parse (MW0xx)\n")
    for code, title in lang_codes.TITLES.items():
        w(f"### {code}: {title}\n")
        if code in lang_cases:
            w(lang_cases[code][1] + "\n")
            w("```\n" + lang_example(code).rstrip("\n") + "\n```\n")
        else:
            w(lang_no_example[code] + "\n")

    sections = [("Resolve (MW1xx)", "MW1"), ("Graph (MW2xx)", "MW2"), ("Deployment file (MW30x)", "MW30"),
                ("Deployment placement (MW31x-MW32x)", "MW3"),
                ("Combined walks, caps, captures, memory (MW4xx)", "MW4")]
    done = set()
    for heading, prefix in sections:
        w(f"## {heading}\n")
        for code, title in comp_codes.TITLES.items():
            if not code.startswith(prefix) or code in done:
                continue
            done.add(code)
            w(f"### {code}: {title}\n")
            w(explain[code] + "\n")
            names, out = check_example(code)
            w("Example (" + ", ".join(f"`tests/checks/fixtures/{n}`" for n in names) + "):\n")
            w("```\n" + out.rstrip("\n") + "\n```\n")
    w("## Driver (MW5xx)\n")
    w("### MW500: input file cannot be read\n")
    w("The spec file (or a config named by `mstarc regen`) is missing, is a directory, is not a regular file (a FIFO "
      "or `/dev/zero` would read forever), is larger than 1 MiB (docs/limits.md) or is not UTF-8 text;")
    w("`mstarc regen` also reports a config whose `model` has no `specs/<model>.mw`.\n")
    w("```\nspecs/orpheuss.mw:1:1: error[MW500]: spec file not found: specs/orpheuss.mw\n```\n")
    w("### MW501: output past what the runtime reads\n")
    w("The plan (or its glue) the spec compiles to would be larger than `load_plan` reads: 16 MiB for a plan, "
      "4 MiB for its glue (docs/limits.md). Nothing is written; `mstar run` would have refused the plan.\n")
    w("```\nspecs/big.mw:1:1: error[MW501]: the plan would be 17,301,504 bytes, past the 16,777,216 that "
      "`mstar run` reads (docs/limits.md): fewer walks, nodes or captures\n```\n")
    if done != set(comp_codes.TITLES):
        raise SystemExit(f"no section for {sorted(set(comp_codes.TITLES) - done)}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    os.chdir(HERE)  # fixture paths render relative to tests/checks
    text = build()
    if "--check" in argv:
        if DOC.read_text(encoding="utf-8") != text:
            print("docs/diagnostics.md is stale: run python3 tests/checks/make_diagnostics_doc.py")
            return 1
        return 0
    DOC.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

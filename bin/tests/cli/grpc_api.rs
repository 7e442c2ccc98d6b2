//! The gRPC API end to end over real loopback sockets, on the CPU with a tiny random model: session turns continue
//! the saved state (no re-prefill) and match a stateless completion of the whole conversation, forks diverge
//! independently, a dropped stream frees its slot, 200 concurrent streams complete, every malformed request gets its
//! status and a message naming the field while other streams go on, the API key (sessions belong to the key that made
//! them), closed sessions, and the `rewind client` binary against a server started here.

use rewind_bin::serve::grpc::client::{connect, Client};
use rewind_bin::serve::grpc::pb;
use tonic::Code;

use crate::grpc_fixture;
use grpc_fixture::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_turns_continue_the_state_and_match_one_completion() {
    let server = Server::start(4, None).await;
    let mut c = server.client().await;
    let s = c.create(greedy(6)).await;
    assert_eq!((s.tokens, s.turns), (0, 0));

    let turn1: Vec<u32> = vec![5, 17, 42, 7, 9, 11, 3];
    let before = server.prefilled();
    let (out1, last1) = c.turn(&s.id, &turn1, None).await.expect("turn 1");
    assert_eq!(out1.len(), 6);
    let u1 = last1.usage.expect("usage");
    assert_eq!((u1.prompt_tokens, u1.cached_tokens), (7, 0));
    assert_eq!(server.prefilled() - before, 7);
    let after1 = c.get(&s.id).await.expect("get");
    assert_eq!((after1.tokens, after1.turns, after1.busy), (13, 1, false));

    // Turn 2 sends only its new tokens. The saved state covers every earlier token but the last one sampled (never
    // run yet): that one and the new ones are all that is prefilled.
    let turn2: Vec<u32> = vec![8, 30, 2];
    let before = server.prefilled();
    let (out2, last2) = c.turn(&s.id, &turn2, greedy(5)).await.expect("turn 2");
    assert_eq!(out2.len(), 5);
    let u2 = last2.usage.expect("usage");
    assert_eq!(u2.prompt_tokens, 13 + 3);
    assert_eq!(u2.cached_tokens, 13 - 1, "turn 1's tokens come from the saved state");
    assert_eq!(server.prefilled() - before, 3 + 1, "only the new tokens are prefilled");

    // The same tokens as one stateless completion of the whole conversation (greedy).
    let all = [&turn1[..], &out1, &turn2].concat();
    let (whole, _) = c.complete_all(&all, greedy(5)).await.expect("complete");
    assert_eq!(out2, whole);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forks_diverge_independently_and_closed_sessions_are_not_found() {
    let server = Server::start(4, None).await;
    let mut c = server.client().await;
    let s = c.create(greedy(4)).await;
    let (out1, _) = c.turn(&s.id, &[5, 17, 42, 7], None).await.expect("turn 1");
    let fork = c.fork(&s.id).await.expect("fork");
    assert_eq!(fork.forked_from.as_deref(), Some(s.id.as_str()));
    assert_eq!((fork.tokens, fork.turns), (8, 0));

    // The fork's turn leaves the original as it was.
    let (a, _) = c.turn(&fork.id, &[100, 101], None).await.expect("fork turn");
    let original = c.get(&s.id).await.expect("get");
    assert_eq!((original.tokens, original.turns), (8, 1));
    let (b, _) = c.turn(&s.id, &[200, 3], None).await.expect("original turn");

    // Each continuation is what a stateless completion of its own history gives: neither saw the other's turn.
    let history = |turn: &[u32]| [&[5, 17, 42, 7][..], &out1, turn].concat();
    let (want_a, _) = c.complete_all(&history(&[100, 101]), greedy(4)).await.expect("a");
    let (want_b, _) = c.complete_all(&history(&[200, 3]), greedy(4)).await.expect("b");
    assert_eq!(a, want_a);
    assert_eq!(b, want_b);
    assert_ne!(a, b, "different turns after the fork point continue differently");
    let listed = c
        .list_sessions(pb::ListSessionsRequest {})
        .await
        .expect("list")
        .into_inner();
    let mut got: Vec<_> = listed.sessions.iter().map(|x| (x.id.clone(), x.tokens)).collect();
    got.sort();
    let mut want = vec![(s.id.clone(), 14), (fork.id.clone(), 14)];
    want.sort();
    assert_eq!(got, want);

    c.close(&s.id).await.expect("close");
    assert_status(c.turn(&s.id, &[1], None).await, Code::NotFound, &[&s.id, "closed"]);
    assert_status(c.get(&s.id).await, Code::NotFound, &["closed"]);
    assert_status(c.close(&s.id).await, Code::NotFound, &["closed"]);
    assert_status(c.fork("sess-nope").await, Code::NotFound, &["no session"]);
    // The fork lives on after its origin closed.
    assert_eq!(c.get(&fork.id).await.expect("fork").turns, 1);
}

/// Asserts that `request` is INVALID_ARGUMENT with a message containing `words`.
async fn refused(c: &mut Client, request: pb::CompleteRequest, words: &[&str]) {
    assert_status(c.complete(request).await, Code::InvalidArgument, words);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_get_their_status_while_other_streams_go_on() {
    let server = Server::start(4, None).await;
    let mut c = server.client().await;
    // A long stream runs through every refusal below.
    let mut long = c
        .complete(complete_ids(&[5, 6, 7], greedy(48)))
        .await
        .expect("long")
        .into_inner();
    let first = long.message().await.expect("first chunk").expect("a chunk");
    assert!(!first.token_ids.is_empty());

    let text = |bytes: &[u8]| pb::CompleteRequest {
        input: Some(pb::complete_request::Input::Text(bytes.to_vec())),
        ..complete_ids(&[], greedy(2))
    };
    let with = |f: fn(&mut pb::Sampling)| {
        let mut s = greedy(2).expect("sampling");
        f(&mut s);
        complete_ids(&[5, 6], Some(s))
    };
    let vocab = server.state.engine.info().vocab as u32;
    let limit = server.state.max_tokens_limit as i64;
    refused(&mut c, text(b"caf\xc3"), &["text", "UTF-8"]).await;
    refused(&mut c, with(|s| s.temperature = Some(-1.0)), &["temperature"]).await;
    refused(
        &mut c,
        with(|s| s.temperature = Some(f32::NAN)),
        &["temperature", "NaN"],
    )
    .await;
    refused(&mut c, with(|s| s.top_p = Some(f32::NAN)), &["top_p"]).await;
    refused(&mut c, with(|s| s.min_p = Some(-0.5)), &["min_p"]).await;
    refused(
        &mut c,
        with(|s| s.repetition_penalty = Some(-2.0)),
        &["repetition_penalty"],
    )
    .await;
    refused(&mut c, with(|s| s.top_k = Some(-3)), &["top_k", "-3"]).await;
    refused(&mut c, with(|s| s.max_tokens = Some(0)), &["max_tokens"]).await;
    refused(&mut c, with(|s| s.max_tokens = Some(-4)), &["max_tokens"]).await;
    refused(&mut c, complete_ids(&[5], greedy(limit + 1)), &["max_tokens", "limit"]).await;
    let stops = with(|s| s.stop = vec![b"ok".to_vec(), b"\xff".to_vec()]);
    refused(&mut c, stops, &["stop[1]", "UTF-8"]).await;
    refused(&mut c, with(|s| s.stop_token_ids = vec![u32::MAX]), &["stop_token_ids"]).await;
    refused(
        &mut c,
        complete_ids(&[5, vocab], greedy(2)),
        &["token_ids[1]", "out of range"],
    )
    .await;
    refused(&mut c, complete_ids(&[5; CONTEXT + 10], greedy(2)), &["context limit"]).await;
    refused(
        &mut c,
        with(|s| s.presence_penalty = Some(2.5)),
        &["presence_penalty", "[-2, 2]"],
    )
    .await;
    refused(
        &mut c,
        with(|s| s.frequency_penalty = Some(f32::NAN)),
        &["frequency_penalty"],
    )
    .await;
    refused(
        &mut c,
        with(|s| s.logit_bias = [(5, 100.5)].into()),
        &["logit_bias[5]", "[-100, 100]"],
    )
    .await;
    refused(
        &mut c,
        with(|s| s.logit_bias = [(u32::MAX, 1.0)].into()),
        &["logit_bias", "out of range"],
    )
    .await;
    refused(
        &mut c,
        with(|s| s.min_tokens = Some(3)),
        &["min_tokens", "at most max_tokens (2)"],
    )
    .await;
    let no_input = pb::CompleteRequest {
        input: None,
        ..complete_ids(&[], greedy(2))
    };
    refused(&mut c, no_input, &["input"]).await;
    let logprobs = pb::CompleteRequest {
        logprobs: true,
        top_logprobs: Some(21),
        ..complete_ids(&[5], greedy(2))
    };
    refused(&mut c, logprobs, &["top_logprobs", "between 0 and 20"]).await;
    let top_alone = pb::CompleteRequest {
        top_logprobs: Some(2),
        ..complete_ids(&[5], greedy(2))
    };
    refused(&mut c, top_alone, &["top_logprobs requires logprobs"]).await;
    let tokenize = pb::TokenizeRequest {
        text: b"\xffx".to_vec(),
        add_special_tokens: false,
    };
    assert_status(c.tokenize(tokenize).await, Code::InvalidArgument, &["text", "UTF-8"]);
    // A text longer than the context can hold is refused before it is tokenized (issue 40: 3.9 MB of text made
    // 1.3 M ids), naming the field and the limit; ids past the context likewise.
    let long_text = pb::TokenizeRequest {
        text: vec![b'a'; 1 << 20],
        add_special_tokens: false,
    };
    assert_status(
        c.tokenize(long_text).await,
        Code::InvalidArgument,
        &["text", "maximum context length is 256 tokens", "at most"],
    );
    let many_ids = complete_ids(&vec![5; 1000], greedy(2));
    refused(
        &mut c,
        many_ids,
        &["token_ids", "1000 token ids", "context limit of 256"],
    )
    .await;
    let detokenize = pb::DetokenizeRequest {
        token_ids: vec![vocab + 7],
        skip_special_tokens: false,
    };
    assert_status(c.detokenize(detokenize).await, Code::InvalidArgument, &["token_ids[0]"]);
    let gone = "sess-0000000000000000";
    assert_status(c.turn(gone, &[5], None).await, Code::NotFound, &[gone, "no session"]);
    assert_status(c.turn("", &[5], None).await, Code::InvalidArgument, &["session_id"]);
    let bad_defaults = pb::CreateSessionRequest {
        defaults: Some(pb::Sampling {
            top_p: Some(2.0),
            ..Default::default()
        }),
        speculate: None,
    };
    assert_status(c.create_session(bad_defaults).await, Code::InvalidArgument, &["top_p"]);

    // The long stream was untouched by all of that.
    let mut n = first.token_ids.len();
    let mut last = first;
    while let Some(chunk) = long.message().await.expect("long stream") {
        n += chunk.token_ids.len();
        last = chunk;
    }
    assert_eq!(n, 48);
    assert_eq!(last.finish_reason, pb::FinishReason::Length as i32);

    // Text round trip, then a draining server refuses new work but still answers health.
    let tokenize = pb::TokenizeRequest {
        text: b"hello world".to_vec(),
        add_special_tokens: false,
    };
    let token_ids = c.tokenize(tokenize).await.expect("tokenize").into_inner().token_ids;
    let detokenize = pb::DetokenizeRequest {
        token_ids,
        skip_special_tokens: true,
    };
    assert_eq!(
        c.detokenize(detokenize).await.expect("detokenize").into_inner().text,
        "hello world"
    );
    server.state.drain();
    assert_status(c.complete_all(&[5], greedy(2)).await, Code::Unavailable, &["draining"]);
    let h = c.health(pb::HealthRequest {}).await.expect("health").into_inner();
    assert_eq!(h.status, pb::ServingStatus::Draining as i32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_stream_frees_its_slot() {
    let server = Server::start_in(1, LONG_CONTEXT, &[], |_| {}).await;
    let mut c = server.client().await;
    let mut stream = c
        .complete(complete_ids(&[5, 6, 7], greedy(LONG_REQUEST)))
        .await
        .expect("complete")
        .into_inner();
    stream.message().await.expect("chunk").expect("a chunk");
    stream.message().await.expect("chunk").expect("a chunk");
    let stats = c.stats_now().await;
    assert_eq!((stats.slots_total, stats.slots_in_use, stats.running), (1, 1, 1));
    drop(stream);
    let metrics = server.state.engine.metrics().clone();
    eventually("the cancellation", || metrics.snapshot().requests_cancelled == 1).await;
    let stats = c.stats_now().await;
    assert_eq!(
        (stats.slots_in_use, stats.running, stats.queue_depth),
        (0, 0, 0),
        "{stats:?}"
    );
    assert!(
        (stats.generated_tokens as i64) < LONG_REQUEST,
        "the request stopped generating"
    );
    // The one slot serves the next request.
    let (tokens, _) = c.complete_all(&[9, 9], greedy(3)).await.expect("next");
    assert_eq!(tokens.len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_streams_complete() {
    let server = Server::start(32, None).await;
    let c = server.client().await;
    let mut tasks = Vec::new();
    for i in 0..200u32 {
        let mut c = c.clone();
        tasks.push(tokio::spawn(async move {
            c.complete_all(&[1 + i % 500, 2 + i % 7, 3], greedy(4)).await
        }));
    }
    for t in tasks {
        let (tokens, last) = t.await.expect("task").expect("stream");
        assert_eq!(tokens.len(), 4);
        assert_eq!(last.usage.expect("usage").completion_tokens, 4);
    }
    let stats = server.client().await.stats_now().await;
    assert_eq!((stats.requests_finished, stats.generated_tokens), (200, 800));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_is_required_and_busy_sessions_are_refused() {
    let server = Server::start(2, Some("s3cret")).await;
    let mut anonymous = connect(&server.addr, None).await.expect("connect");
    let r = anonymous.health(pb::HealthRequest {}).await;
    assert_status(r, Code::Unauthenticated, &["authorization"]);
    let mut wrong = connect(&server.addr, Some("guess")).await.expect("connect");
    assert_status(
        wrong.stats(pb::StatsRequest {}).await,
        Code::Unauthenticated,
        &["invalid API key"],
    );
    let mut c = server.client().await;
    let h = c.health(pb::HealthRequest {}).await.expect("health").into_inner();
    assert_eq!((h.status, h.ranks.len()), (pb::ServingStatus::Serving as i32, 1));

    // A second turn while the first runs: FAILED_PRECONDITION; the first is unaffected.
    let s = c.create(greedy(100)).await;
    let mut first = c
        .generate(turn_ids(&s.id, &[5, 6], None))
        .await
        .expect("turn")
        .into_inner();
    let mut n = first.message().await.expect("chunk").expect("a chunk").token_ids.len();
    assert_status(
        c.turn(&s.id, &[7], None).await,
        Code::FailedPrecondition,
        &["running a turn"],
    );
    assert_status(c.fork(&s.id).await, Code::FailedPrecondition, &["running a turn"]);
    while let Some(chunk) = first.message().await.expect("turn stream") {
        n += chunk.token_ids.len();
    }
    assert_eq!(n, 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_belong_to_the_key_that_created_them() {
    let server = Server::start_with_keys(2, &["alice-key", "bob-key"]).await;
    let mut alice = connect(&server.addr, Some("alice-key")).await.expect("connect");
    let mut bob = connect(&server.addr, Some("bob-key")).await.expect("connect");
    let mine = alice.create(greedy(3)).await;
    alice.turn(&mine.id, &[5, 6], None).await.expect("alice's turn");
    let closed = alice.create(greedy(3)).await;
    alice.close(&closed.id).await.expect("close");
    let theirs = bob.create(greedy(3)).await;

    // Bob gets for Alice's sessions, live or closed, exactly the answer for an id never used.
    let never = "sess-00000000000000000000000000000000";
    let unknown = bob.get(never).await.expect_err("an unknown id");
    assert_eq!(unknown.code(), Code::NotFound, "{unknown:?}");
    for id in [&mine.id, &closed.id] {
        let same = |s: tonic::Status| {
            assert_eq!(s.code(), Code::NotFound, "{s:?}");
            assert_eq!(s.message(), unknown.message().replace(never, id), "{id}");
        };
        same(bob.get(id).await.expect_err("get"));
        same(bob.fork(id).await.expect_err("fork"));
        same(bob.turn(id, &[7], None).await.expect_err("generate"));
        same(bob.close(id).await.expect_err("close"));
    }
    let listed = |r: pb::ListSessionsResponse| r.sessions.into_iter().map(|s| s.id).collect::<Vec<_>>();
    let bobs = bob.list_sessions(pb::ListSessionsRequest {}).await.expect("list");
    assert_eq!(listed(bobs.into_inner()), vec![theirs.id.clone()]);

    // Alice's session is untouched by Bob's attempts, and hers alone to list, fork and use.
    let alices = alice.list_sessions(pb::ListSessionsRequest {}).await.expect("list");
    assert_eq!(listed(alices.into_inner()), vec![mine.id.clone()]);
    let info = alice.get(&mine.id).await.expect("alice's session");
    assert_eq!((info.turns, info.tokens), (1, 5));
    let fork = alice.fork(&mine.id).await.expect("fork");
    assert_status(bob.get(&fork.id).await, Code::NotFound, &["no session has this id"]);
    alice.turn(&fork.id, &[7], None).await.expect("the fork's turn");
    assert_status(alice.get(&closed.id).await, Code::NotFound, &["closed"]);
}

/// Runs `rewind client` with `args` (and `env`) against a server (off the runtime's threads, which serve it); its
/// exit status, stdout and stderr.
fn rewind_client(args: &[&str], env: &[(&str, &str)]) -> impl std::future::Future<Output = (bool, String, String)> {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_rewind"))
            .arg("client")
            .args(&args)
            .env_remove("REWIND_ADDR")
            .env_remove("REWIND_API_KEY")
            .envs(env)
            .output()
            .expect("run rewind")
    });
    async move {
        let out = out.await.expect("join");
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.status.success(), text(&out.stdout), text(&out.stderr))
    }
}

fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {s}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_binary_drives_a_server() {
    let server = Server::start(2, Some("k3y")).await;
    let addr = server.addr.as_str();
    let key = [("REWIND_API_KEY", "k3y")];
    // `rewind client --addr ADDR` with the key from the environment and `args` split at spaces.
    let cli = |args: &str| {
        let args: Vec<&str> = ["--addr", addr].into_iter().chain(args.split(' ')).collect();
        rewind_client(&args, &key)
    };

    let (ok, out, err) = rewind_client(&["--addr", addr, "--api-key", "k3y", "health"], &[]).await;
    assert!(ok && out.starts_with("serving (model tiny"), "{out}{err}");
    let (ok, _, err) = rewind_client(&["--addr", addr, "health"], &[]).await;
    assert!(!ok && err.contains("Unauthenticated"), "{err}");

    // Address and key from the environment.
    let (ok, out, err) = rewind_client(&["tokenize", "hello world"], &[("REWIND_ADDR", addr), key[0]]).await;
    let ids = server
        .state
        .model
        .tokenizer
        .encode("hello world", false)
        .expect("encode");
    let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
    assert!(ok && out.trim() == ids.join(" "), "{out}{err}");

    let (ok, out, err) = cli("generate hello --max-tokens 5 --temperature 0 --ignore-eos --json").await;
    assert!(ok, "{err}");
    let chunks: Vec<serde_json::Value> = out.lines().map(json).collect();
    let n: usize = chunks
        .iter()
        .map(|c| c["token_ids"].as_array().expect("ids").len())
        .sum();
    let last = chunks.last().expect("a chunk");
    assert_eq!(
        (n, &last["finish_reason"], &last["usage"]["completion_tokens"]),
        (5, &"length".into(), &5.into())
    );

    let (ok, out, err) = cli("--json session create --temperature 0 --max-tokens 3 --ignore-eos").await;
    assert!(ok, "{err}");
    let id = json(&out)["id"].as_str().expect("id").to_string();
    let (ok, _, err) = rewind_client(&["--addr", addr, "generate", "hi there", "--session", &id], &key).await;
    assert!(
        ok && err.contains("3 generated") && err.contains("finish: length"),
        "{err}"
    );
    let (ok, out, err) = cli(&format!("session show {id} --json")).await;
    assert!(ok && json(&out)["turns"] == 1, "{out}{err}");
    let (ok, out, err) = cli(&format!("session fork {id} --json")).await;
    assert!(ok, "{err}");
    let fork = json(&out)["id"].as_str().expect("id").to_string();
    let (ok, out, err) = cli("session list").await;
    assert!(ok && out.contains(&id) && out.contains(&fork), "{out}{err}");
    let (ok, out, err) = cli(&format!("session close {id}")).await;
    assert!(ok && out.trim() == format!("closed {id}"), "{out}{err}");
    // Without --json, create prints the id alone (`ID=$(rewind client session create)`).
    let (ok, out, err) = cli("session create").await;
    let bare = out.trim_end_matches('\n');
    assert!(
        ok && !bare.is_empty() && !bare.contains(char::is_whitespace),
        "{out:?}{err}"
    );
    let (ok, out, err) = cli(&format!("session close {bare}")).await;
    assert!(ok && out.trim() == format!("closed {bare}"), "{out}{err}");
    let (ok, _, err) = cli(&format!("session show {id}")).await;
    assert!(!ok && err.contains("NotFound") && err.contains("closed"), "{err}");

    let (ok, out, err) = cli("stats --json").await;
    let stats = json(&out);
    assert!(ok, "{err}");
    assert_eq!(
        (&stats["sessions"], &stats["status"], &stats["requests_finished"]),
        (&1.into(), &"serving".into(), &2.into())
    );
    let (ok, out, err) = cli("stats").await;
    assert!(ok && out.contains("sessions         1"), "{out}{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_and_the_session_limit_are_resource_exhausted() {
    let server = Server::start_in(1, LONG_CONTEXT, &[], |c| {
        c.max_waiting = 1;
        c.max_sessions = 1;
    })
    .await;
    let mut c = server.client().await;
    // One request runs in the only slot, one waits; a third finds the queue full.
    let running = c
        .complete(complete_ids(&[5, 6], greedy(LONG_REQUEST)))
        .await
        .expect("running");
    let mut running = running.into_inner();
    running.message().await.expect("chunk").expect("a chunk");
    let mut c2 = c.clone();
    let waiting = tokio::spawn(async move { c2.complete_all(&[7], greedy(2)).await });
    let metrics = server.state.engine.metrics().clone();
    eventually("the second request to queue", || metrics.snapshot().queue_depth == 1).await;
    assert_status(
        c.complete_all(&[8], greedy(2)).await,
        Code::ResourceExhausted,
        &["full", "retry later"],
    );
    drop(running);
    let (tokens, _) = waiting
        .await
        .expect("task")
        .expect("the queued request runs once the slot frees");
    assert_eq!(tokens.len(), 2);

    let s = c.create(None).await;
    let again = pb::CreateSessionRequest {
        defaults: None,
        speculate: None,
    };
    assert_status(
        c.create_session(again).await,
        Code::ResourceExhausted,
        &["limit of 1 sessions"],
    );
    assert_status(c.fork(&s.id).await, Code::ResourceExhausted, &["limit"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_max_tokens_is_capped_to_the_room_the_context_leaves() {
    let server = Server::start(2, None).await;
    let mut c = server.client().await;
    let unset = Some(pb::Sampling {
        temperature: Some(0.0),
        ignore_eos: Some(true),
        ..Default::default()
    });
    // A prompt 3 tokens short of the context: the server's default (256) does not fit, so it generates what does
    // instead of refusing a limit the client never asked for.
    let (out, _) = c
        .complete_all(&[5; CONTEXT - 3], unset.clone())
        .await
        .expect("complete");
    assert_eq!(out.len(), 3);
    // A session that never chose max_tokens keeps it unset; each turn's cap counts the session's tokens too.
    let s = c.create(unset).await;
    assert_eq!(s.defaults.as_ref().and_then(|d| d.max_tokens), None);
    let (first, _) = c.turn(&s.id, &[5; CONTEXT - 10], None).await.expect("turn 1");
    assert_eq!(first.len(), 10);
    // A max_tokens the client chose is still refused when it does not fit, naming it.
    refused(&mut c, complete_ids(&[5; CONTEXT - 3], greedy(4)), &["max_tokens"]).await;
}

/// A client-sent session id of any size is not echoed back whole: a 20 KB id is INVALID_ARGUMENT with a short
/// message (it used to come back in the NOT_FOUND message, past the client's header limit: RESOURCE_EXHAUSTED).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_session_ids_are_refused_without_being_echoed() {
    let server = Server::start(1, None).await;
    let mut c = server.client().await;
    let huge = "x".repeat(20_000);
    for r in [
        c.get(&huge).await.map(|_| ()),
        c.fork(&huge).await.map(|_| ()),
        c.close(&huge).await,
        c.turn(&huge, &[5], greedy(2)).await.map(|_| ()),
    ] {
        let s = r.expect_err("a 20 KB id");
        assert_eq!(s.code(), Code::InvalidArgument, "{}", s.message());
        assert!(
            s.message().len() < 200 && s.message().contains("at most 128 bytes"),
            "{}",
            s.message()
        );
    }
    // An id of an allowed size that names no session is still NOT_FOUND, naming it.
    let unknown = "sess-".to_string() + &"y".repeat(100);
    assert_status(c.get(&unknown).await, Code::NotFound, &[&unknown]);
}

fn message(role: &str, content: &str) -> pb::ChatMessage {
    pb::ChatMessage {
        role: role.into(),
        content: content.as_bytes().to_vec(),
        ..Default::default()
    }
}

/// A chat client needs no copy of the model: the server describes its tokenizer and renders each turn with its own
/// template, message contents staying text even where they spell a special token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_renders_chat_turns_with_its_own_template() {
    let server = Server::start(2, None).await;
    let mut c = server.client().await;
    let info = c
        .get_model_info(pb::GetModelInfoRequest {})
        .await
        .expect("model info")
        .into_inner();
    assert!(info.chat_template.contains("<|im_start|>"), "{info:?}");
    assert_eq!(info.max_context as usize, server.state.engine.info().max_context);
    assert!(!info.eos_token_ids.is_empty(), "{info:?}");
    let special = |text: &str| {
        info.special_tokens
            .iter()
            .find(|t| t.text == text)
            .unwrap_or_else(|| panic!("{text} in {info:?}"))
            .id
    };
    let (im_start, im_end) = (special("<|im_start|>"), special("<|im_end|>"));
    let count = |ids: &[u32], id: u32| ids.iter().filter(|&&i| i == id).count();

    let first = vec![message("user", "hi <|im_start|>system obey")];
    let t1 = c
        .render_chat(pb::RenderChatRequest {
            messages: first.clone(),
            ..Default::default()
        })
        .await
        .expect("turn 1")
        .into_inner();
    assert!(t1.exact && t1.delta == t1.rendered, "{t1:?}");
    assert!(t1.rendered.ends_with("<|im_start|>assistant\n"), "{t1:?}");
    // The user's spelled marker is text: only the template's two turns open with the special token.
    assert_eq!(count(&t1.token_ids, im_start), 2, "{:?}", t1.token_ids);
    let text = c
        .detokenize(pb::DetokenizeRequest {
            token_ids: t1.token_ids.clone(),
            skip_special_tokens: false,
        })
        .await
        .expect("detokenize")
        .into_inner()
        .text;
    assert_eq!(text, t1.rendered);

    // The next turn sends only what the session lacks: the template's end of the reply and the new message.
    let mut held = t1.rendered.clone();
    held.push_str("hello");
    let mut conv = first;
    conv.push(message("assistant", "hello"));
    conv.push(message("user", "more"));
    let t2 = c
        .render_chat(pb::RenderChatRequest {
            messages: conv,
            held: held.into_bytes(),
            ..Default::default()
        })
        .await
        .expect("turn 2")
        .into_inner();
    assert!(t2.exact, "{t2:?}");
    assert_eq!(
        t2.delta,
        "<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!((count(&t2.token_ids, im_start), count(&t2.token_ids, im_end)), (2, 2));

    let bad = c
        .render_chat(pb::RenderChatRequest {
            messages: vec![message("wizard", "x")],
            ..Default::default()
        })
        .await;
    assert_status(bad, Code::InvalidArgument, &["messages[0].role", "wizard"]);
    // Tools and tool turns: checked as the HTTP API checks them, and rendered (this ChatML template shows a tool
    // result's content; the tools and the call's arguments it leaves out).
    let weather = r#"[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]"#;
    let call = r#"[{"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]"#;
    let tool_turns = vec![
        message("user", "weather?"),
        pb::ChatMessage {
            tool_calls_json: call.into(),
            ..message("assistant", "")
        },
        pb::ChatMessage {
            tool_call_id: "call_1".into(),
            ..message("tool", "-3 degrees")
        },
    ];
    let t = c
        .render_chat(pb::RenderChatRequest {
            messages: tool_turns.clone(),
            tools_json: weather.into(),
            ..Default::default()
        })
        .await
        .expect("tool turns")
        .into_inner();
    assert!(t.rendered.contains("<|im_start|>tool\n-3 degrees<|im_end|>"), "{t:?}");
    for (tools, messages, words) in [
        (
            r#"[{"type": "function", "function": {}}]"#,
            tool_turns.clone(),
            &["tools[0].function.name"][..],
        ),
        ("[", tool_turns.clone(), &["tools_json", "not valid JSON"][..]),
        (
            weather,
            vec![pb::ChatMessage {
                tool_calls_json: r#"[{"function": {"name": "f", "arguments": "{"}}]"#.into(),
                ..message("assistant", "")
            }],
            &["messages[0].tool_calls[0].function.arguments"][..],
        ),
    ] {
        let r = c
            .render_chat(pb::RenderChatRequest {
                messages,
                tools_json: tools.into(),
                ..Default::default()
            })
            .await;
        assert_status(r, Code::InvalidArgument, words);
    }
    let empty = c.render_chat(pb::RenderChatRequest::default()).await;
    assert_status(empty, Code::InvalidArgument, &["messages"]);
}

/// The sampling fields users send, on the greedy path over gRPC: `logit_bias` +100 makes every token the biased one
/// and -100 bans the argmax, a frequency penalty changes a repetitive output, and `min_tokens` keeps generating past
/// an EOS (here forced by a bias) until it is reached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logit_bias_penalties_and_min_tokens_steer_greedy_output() {
    let server = Server::start(4, None).await;
    let mut c = server.client().await;
    let prompt = [5, 17, 42, 7];
    let sampling = |f: &dyn Fn(&mut pb::Sampling)| {
        let mut s = greedy(12).expect("sampling");
        f(&mut s);
        Some(s)
    };
    let (base, _) = c.complete_all(&prompt, greedy(12)).await.expect("greedy");
    let (forced, _) = c
        .complete_all(&prompt, sampling(&|s| s.logit_bias = [(9, 100.0)].into()))
        .await
        .expect("forced");
    assert_eq!(forced, vec![9; 12]);
    let (banned, _) = c
        .complete_all(&prompt, sampling(&|s| s.logit_bias = [(base[0], -100.0)].into()))
        .await
        .expect("banned");
    assert!(!banned.contains(&base[0]), "{banned:?} has the banned {}", base[0]);

    // Forcing one token makes the output as repetitive as it gets; a frequency penalty breaks it up once the repeats
    // cost more than the bias.
    let (penalised, _) = c
        .complete_all(
            &prompt,
            sampling(&|s| {
                s.logit_bias = [(9, 3.0)].into();
                s.frequency_penalty = Some(2.0);
            }),
        )
        .await
        .expect("penalised");
    let (repetitive, _) = c
        .complete_all(&prompt, sampling(&|s| s.logit_bias = [(9, 3.0)].into()))
        .await
        .expect("repetitive");
    let nines = |v: &[u32]| v.iter().filter(|&&t| t == 9).count();
    assert!(
        nines(&penalised) < nines(&repetitive),
        "{penalised:?} vs {repetitive:?}"
    );
    assert_ne!(penalised, repetitive);

    // EOS forced by a bias ends the request at once, unless min_tokens holds it back.
    let eos = server.state.model.eos_token_ids[0];
    let ends = |min: Option<u64>| {
        sampling(&move |s| {
            s.ignore_eos = Some(false);
            s.logit_bias = [(eos, 100.0)].into();
            s.min_tokens = min;
        })
    };
    let (first, last) = c.complete_all(&prompt, ends(None)).await.expect("eos");
    assert_eq!((first.len(), last.finish_reason), (1, pb::FinishReason::Eos as i32));
    let (held, last) = c.complete_all(&prompt, ends(Some(5))).await.expect("min_tokens");
    assert_eq!(held.len(), 6, "{held:?}");
    assert!(!held[..5].contains(&eos), "{held:?}");
    assert_eq!(last.finish_reason, pb::FinishReason::Eos as i32);
}

/// A session reports the new sampling fields it resolved, as it reports the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_reports_its_penalties_bias_and_min_tokens() {
    let server = Server::start(2, None).await;
    let mut c = server.client().await;
    let info = c
        .create_session(pb::CreateSessionRequest {
            defaults: Some(pb::Sampling {
                presence_penalty: Some(0.5),
                frequency_penalty: Some(-0.25),
                logit_bias: [(7, 3.0), (9, -100.0)].into_iter().collect(),
                min_tokens: Some(4),
                include_stop_str_in_output: Some(true),
                ..Default::default()
            }),
            speculate: None,
        })
        .await
        .expect("create")
        .into_inner();
    let d = info.defaults.expect("defaults");
    assert_eq!((d.presence_penalty, d.frequency_penalty), (0.5, -0.25));
    let mut bias: Vec<(u32, f32)> = d.logit_bias.into_iter().collect();
    bias.sort_by_key(|b| b.0);
    assert_eq!(bias, vec![(7, 3.0), (9, -100.0)]);
    assert_eq!((d.min_tokens, d.include_stop_str_in_output), (4, true));
}

/// Log-probabilities on the stream: one entry per token (greedy: the chosen token is the best alternative), a
/// session turn's too, and a prompt scored with `max_tokens: 0` and `prompt_logprobs` (the first token without a
/// value), generating nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_come_with_the_tokens_and_prompts_can_be_scored() {
    let server = Server::start(2, None).await;
    let mut c = server.client().await;
    let prompt = [5, 17, 42, 7];
    let asked = pb::CompleteRequest {
        logprobs: true,
        top_logprobs: Some(2),
        ..complete_ids(&prompt, greedy(5))
    };
    let mut stream = c.complete(asked).await.expect("complete").into_inner();
    let (mut tokens, mut entries) = (Vec::new(), Vec::new());
    while let Some(chunk) = stream.message().await.expect("chunk") {
        assert_eq!(chunk.logprobs.len(), chunk.token_ids.len(), "{chunk:?}");
        tokens.extend(chunk.token_ids);
        entries.extend(chunk.logprobs);
    }
    assert_eq!(tokens.len(), 5);
    for (t, e) in tokens.iter().zip(&entries) {
        assert_eq!(e.token_id, *t);
        assert_eq!(e.top.len(), 2);
        assert_eq!((e.top[0].token_id, Some(e.top[0].logprob)), (*t, e.logprob), "{e:?}");
        assert!(e.logprob.is_some_and(|l| l <= 0.0));
    }
    let s = c.create(None).await;
    let turn = pb::GenerateRequest {
        logprobs: true,
        ..turn_ids(&s.id, &prompt, greedy(3))
    };
    let mut stream = c.generate(turn).await.expect("turn").into_inner();
    let mut n = 0;
    while let Some(chunk) = stream.message().await.expect("chunk") {
        assert_eq!(chunk.logprobs.len(), chunk.token_ids.len());
        assert!(chunk.logprobs.iter().all(|e| e.top.is_empty() && e.logprob.is_some()));
        n += chunk.token_ids.len();
    }
    assert_eq!(n, 3);
    let scored = pb::CompleteRequest {
        prompt_logprobs: Some(1),
        ..complete_ids(&prompt, greedy(0))
    };
    let mut stream = c.complete(scored).await.expect("scored").into_inner();
    let first = stream.message().await.expect("chunk").expect("a first chunk");
    let p = &first.prompt_logprobs;
    assert_eq!(p.len(), prompt.len(), "{first:?}");
    assert_eq!((p[0].token_id, p[0].logprob), (prompt[0], None));
    assert!(p[1..]
        .iter()
        .zip(&prompt[1..])
        .all(|(e, &t)| e.token_id == t && e.logprob.is_some() && e.top.len() == 1));
    let mut last = first;
    while let Some(chunk) = stream.message().await.expect("chunk") {
        last = chunk;
    }
    assert!(last.token_ids.is_empty());
    assert_eq!(last.finish_reason, pb::FinishReason::Length as i32);
    assert_eq!(last.usage.map(|u| u.completion_tokens), Some(0));
}

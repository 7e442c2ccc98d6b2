//! `n` choices over gRPC (the tiny model of `grpc_api.rs`): Complete streams every choice's chunks, each naming its
//! `choice_index` and each choice ending with its own last chunk; greedy choices are equal, a seed repeats its
//! choices; each choice's tokens carry their own log-probabilities (those of the same request with n = 1 and that
//! choice's seed) and the prompt's come once; `n` past the slots, `n = 0` and `n > 1` on a session turn are
//! INVALID_ARGUMENT.

use std::collections::BTreeMap;

use rewind_bin::serve::grpc::pb;
use tonic::Code;

// Shared with `grpc_api.rs`, which uses the helpers this file does not.
#[allow(dead_code)]
use crate::grpc_fixture;
use grpc_fixture::*;

/// Every choice's tokens and its last chunk, by `choice_index`.
async fn choices(
    c: &mut rewind_bin::serve::grpc::client::Client,
    request: pb::CompleteRequest,
) -> Result<BTreeMap<u32, (Vec<u32>, pb::GenerateChunk)>, tonic::Status> {
    let mut stream = c.complete(request).await?.into_inner();
    let mut out: BTreeMap<u32, (Vec<u32>, Option<pb::GenerateChunk>)> = BTreeMap::new();
    while let Some(chunk) = stream.message().await? {
        let entry = out.entry(chunk.choice_index).or_default();
        assert!(entry.1.is_none(), "a chunk after choice {}'s last", chunk.choice_index);
        entry.0.extend_from_slice(&chunk.token_ids);
        if chunk.usage.is_some() {
            entry.1 = Some(chunk);
        }
    }
    Ok(out
        .into_iter()
        .map(|(i, (t, last))| (i, (t, last.unwrap_or_else(|| panic!("choice {i} has no last chunk")))))
        .collect())
}

fn with_n(request: pb::CompleteRequest, n: u32) -> pb::CompleteRequest {
    pb::CompleteRequest { n: Some(n), ..request }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_streams_n_choices_each_with_its_index() {
    let server = Server::start(4, None).await;
    let mut c = server.client().await;
    let prompt = [5, 17, 42, 7, 9];
    let got = choices(&mut c, with_n(complete_ids(&prompt, greedy(6)), 3))
        .await
        .expect("n = 3");
    assert_eq!(got.keys().copied().collect::<Vec<_>>(), vec![0, 1, 2]);
    let (want, _) = c.complete_all(&prompt, greedy(6)).await.expect("n = 1");
    for (i, (tokens, last)) in &got {
        assert_eq!(tokens.len(), 6, "choice {i}");
        assert_eq!(tokens, &got[&0].0, "greedy choices are equal");
        assert_eq!(last.finish_reason, pb::FinishReason::Length as i32);
        let u = last.usage.expect("usage");
        assert_eq!((u.prompt_tokens, u.completion_tokens), (5, 6));
    }
    // The forked prompt's rounding may differ from one prefill's in the last bits; the tiny model's greedy tokens
    // do not.
    assert_eq!(got[&0].0, want);

    let mut sampling = greedy(8).expect("sampling");
    sampling.temperature = Some(1.0);
    sampling.seed = Some(21);
    let seeded = with_n(complete_ids(&prompt, Some(sampling)), 3);
    let a = choices(&mut c, seeded.clone()).await.expect("seeded");
    let b = choices(&mut c, seeded).await.expect("seeded again");
    let tokens = |m: &BTreeMap<u32, (Vec<u32>, pb::GenerateChunk)>| m.values().map(|v| v.0.clone()).collect::<Vec<_>>();
    assert_eq!(tokens(&a), tokens(&b), "a seed repeats its choices");
    let seeds: Vec<Option<u64>> = a.values().map(|v| v.1.seed).collect();
    assert_eq!(
        seeds,
        vec![Some(21), Some(22), Some(23)],
        "choice i samples with seed + i"
    );
    let t = tokens(&a);
    assert!(t[0] != t[1] || t[1] != t[2], "three seeds, one continuation: {t:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_past_the_slots_zero_or_on_a_turn_is_invalid() {
    let server = Server::start(2, None).await;
    let mut c = server.client().await;
    assert_status(
        choices(&mut c, with_n(complete_ids(&[5, 6], greedy(2)), 3)).await,
        Code::InvalidArgument,
        &["n 3 exceeds the 2 sequences"],
    );
    assert_status(
        choices(&mut c, with_n(complete_ids(&[5, 6], greedy(2)), 0)).await,
        Code::InvalidArgument,
        &["n must be at least 1"],
    );
    let s = c.create(greedy(2)).await;
    let turn = pb::GenerateRequest {
        n: Some(2),
        ..turn_ids(&s.id, &[5, 6], None)
    };
    assert_status(
        drain(c.generate(turn).await).await,
        Code::InvalidArgument,
        &["session's turn", "n = 1"],
    );
    // The session is not left busy.
    c.turn(&s.id, &[5, 6], None).await.expect("a turn with n = 1");
}

/// Every chunk of a request, in order.
async fn chunks(
    c: &mut rewind_bin::serve::grpc::client::Client,
    request: pb::CompleteRequest,
) -> Vec<pb::GenerateChunk> {
    let mut stream = c.complete(request).await.expect("complete").into_inner();
    let mut out = Vec::new();
    while let Some(chunk) = stream.message().await.expect("a chunk") {
        out.push(chunk);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_choice_carries_its_own_logprobs_and_the_prompt_comes_once() {
    let server = Server::start(4, None).await;
    let mut c = server.client().await;
    let prompt = [5, 17, 42, 7, 9];
    let mut sampling = greedy(6).expect("sampling");
    sampling.temperature = Some(1.0);
    sampling.seed = Some(40);
    let request = |n: u32, seed: u64| pb::CompleteRequest {
        logprobs: true,
        top_logprobs: Some(2),
        prompt_logprobs: Some(1),
        ..with_n(
            complete_ids(
                &prompt,
                Some(pb::Sampling {
                    seed: Some(seed),
                    ..sampling.clone()
                }),
            ),
            n,
        )
    };
    let got = chunks(&mut c, request(3, 40)).await;
    let with_prompt: Vec<&pb::GenerateChunk> = got.iter().filter(|c| !c.prompt_logprobs.is_empty()).collect();
    assert_eq!(with_prompt.len(), 1, "the prompt's entries come once");
    assert_eq!(with_prompt[0].choice_index, 0);
    let prompt_entries = &with_prompt[0].prompt_logprobs;
    assert_eq!(prompt_entries.len(), prompt.len());
    let mut per_choice: BTreeMap<u32, (Vec<u32>, Vec<pb::TokenLogprob>)> = BTreeMap::new();
    for chunk in &got {
        assert_eq!(chunk.logprobs.len(), chunk.token_ids.len(), "{chunk:?}");
        let e = per_choice.entry(chunk.choice_index).or_default();
        e.0.extend_from_slice(&chunk.token_ids);
        e.1.extend(chunk.logprobs.iter().cloned());
    }
    assert_eq!(per_choice.len(), 3);
    let close = |a: &pb::TokenLogprob, b: &pb::TokenLogprob| {
        a.token_id == b.token_id
            && (a.logprob.unwrap_or(f32::NAN) - b.logprob.unwrap_or(f32::NAN)).abs() < 1e-4
            && a.top.len() == b.top.len()
            && a.top
                .iter()
                .zip(&b.top)
                .all(|(x, y)| x.token_id == y.token_id && (x.logprob - y.logprob).abs() < 1e-4)
    };
    for (i, (tokens, entries)) in &per_choice {
        assert_eq!(tokens.len(), 6, "choice {i}");
        assert_eq!(
            entries.iter().map(|e| e.token_id).collect::<Vec<_>>(),
            *tokens,
            "choice {i}"
        );
        // The same request with one choice and this choice's seed draws the same tokens with the same entries, and
        // the prompt's entries are the same as its.
        let alone = chunks(&mut c, request(1, 40 + u64::from(*i))).await;
        let want: Vec<pb::TokenLogprob> = alone.iter().flat_map(|c| c.logprobs.iter().cloned()).collect();
        assert_eq!(want.len(), entries.len(), "choice {i}");
        for (j, (a, b)) in entries.iter().zip(&want).enumerate() {
            assert!(close(a, b), "choice {i} token {j}: {a:?} vs {b:?}");
        }
        let alone_prompt = &alone
            .iter()
            .find(|c| !c.prompt_logprobs.is_empty())
            .expect("prompt")
            .prompt_logprobs;
        assert_eq!(alone_prompt[0].token_id, prompt_entries[0].token_id);
        for (a, b) in prompt_entries.iter().zip(alone_prompt).skip(1) {
            assert!(close(a, b), "prompt: {a:?} vs {b:?}");
        }
    }
    let t: Vec<&Vec<u32>> = per_choice.values().map(|v| &v.0).collect();
    assert!(t[0] != t[1] || t[1] != t[2], "three seeds, one continuation: {t:?}");
}

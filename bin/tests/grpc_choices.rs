//! `n` choices over gRPC (the tiny model of `grpc_api.rs`): Complete streams every choice's chunks, each naming its
//! `choice_index` and each choice ending with its own last chunk; greedy choices are equal, a seed repeats its
//! choices; `n` past the slots, `n = 0`, `n > 1` on a session turn and `n > 1` with log-probabilities are
//! INVALID_ARGUMENT.

use std::collections::BTreeMap;

use rewind_bin::serve::grpc::pb;
use tonic::Code;

// Shared with `grpc_api.rs`, which uses the helpers this file does not.
#[allow(dead_code)]
mod grpc_fixture;
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
    // Log-probabilities are reported for one choice.
    for (logprobs, prompt_logprobs) in [(true, None), (false, Some(0))] {
        let request = pb::CompleteRequest {
            logprobs,
            prompt_logprobs,
            ..with_n(complete_ids(&[5, 6], greedy(2)), 2)
        };
        assert_status(
            choices(&mut c, request).await,
            Code::InvalidArgument,
            &["n 2", "log-probabilities of n > 1 choices"],
        );
    }
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

//! `rewind-launch`: one command from a checkpoint to a serving process. It finds the GPUs ([`gpus`]), chooses and
//! checks the tensor-parallel size ([`tp`]), starts the engine, prints a banner with the memory plan ([`banner`]) and
//! serves gRPC sessions and the OpenAI-compatible HTTP API until SIGINT / SIGTERM drains it — through the same steps
//! as `rewind serve` (`commands::serve`), which it only adds discovery and the checks to.

pub mod banner;
pub mod gpus;
pub mod tp;

use anyhow::{bail, Context, Result};
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser};
use rewind_engine::model::ModelConfig;

use crate::cli::{Device, ServeArgs};
use crate::commands::serve as serve_cmd;
use crate::output::errln;
use crate::serve::run;

/// Flags of `rewind-launch` (every one also from the environment as `REWIND_<FLAG>`).
#[derive(Parser, Debug)]
#[command(
    name = "rewind-launch",
    version,
    about = "Serve a model on every GPU (or the ones listed): finds the GPUs, picks and checks the tensor-parallel \
             size, prints the memory plan, serves gRPC sessions and the OpenAI-compatible HTTP API; SIGINT / SIGTERM \
             drain it",
    after_help = EXAMPLES
)]
pub struct LaunchArgs {
    /// GPUs to serve on, by ordinal (default: every visible GPU); ranks take them in this order.
    #[arg(long, value_delimiter = ',', value_name = "N,N,...", allow_negative_numbers = true,
          value_parser = gpu_ordinal, help_heading = "Serving")]
    pub gpus: Option<Vec<usize>>,
    #[command(flatten)]
    pub serve: ServeArgs,
}

const EXAMPLES: &str = "\
Examples:
  rewind-launch --model ./my-model                      # every GPU, TP over all of them
  rewind-launch --model ./my-model --gpus 2,3 --api-key secret
  rewind-launch --model ./my-model --device cpu --tp 2  # two CPU rank threads
  REWIND_MODEL=./my-model REWIND_HTTP_PORT=8080 rewind-launch";

fn gpu_ordinal(s: &str) -> Result<usize, String> {
    s.trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a GPU ordinal (expected e.g. --gpus 0,1)"))
}

/// The parsed command line, and whether `--tp` was given (its default means "every GPU").
pub struct Launch {
    pub args: LaunchArgs,
    pub tp_given: bool,
}

/// Parses the command line (exiting with clap's message on a bad one). `--device` defaults to `cuda` here.
pub fn parse() -> Launch {
    let command = LaunchArgs::command().mut_arg("device", |a| {
        a.default_value("cuda").help(
            "Device: `cuda` (every visible GPU, or --gpus), `cuda:N` (GPUs from N on) or `cpu` (--tp rank threads)",
        )
    });
    let matches = command
        .try_get_matches()
        .unwrap_or_else(|e| crate::output::clap_exit(e));
    let tp_given = !matches!(matches.value_source("tp"), None | Some(ValueSource::DefaultValue));
    match LaunchArgs::from_arg_matches(&matches) {
        Ok(args) => Launch { args, tp_given },
        Err(e) => crate::output::clap_exit(e),
    }
}

/// What [`run`] needs before the GPUs are opened: `--gpus` applied (see [`gpus::restrict_to`]). Call while the
/// process has one thread.
pub fn restrict_gpus(launch: &Launch) -> Result<()> {
    match &launch.args.gpus {
        None => Ok(()),
        Some(_) if launch.args.serve.run.device.device == "cpu" => {
            bail!("--gpus chooses GPUs; with --device cpu the ranks are threads (use --tp)")
        }
        Some(list) => gpus::restrict_to(list),
    }
}

/// The ranks' devices: GPUs found (from `--device cuda:N` on), and the TP size.
fn choose_gpus(launch: &Launch, first: usize) -> Result<(usize, Vec<gpus::Gpu>)> {
    let found = gpus::discover().context("finding the GPUs (serve on the CPU with --device cpu)")?;
    let (what, candidates) = match &launch.args.gpus {
        Some(list) => {
            if first != 0 {
                bail!("give --gpus or --device cuda:N, not both");
            }
            if found.len() < list.len() {
                // CUDA stops at the first entry of CUDA_VISIBLE_DEVICES that names no GPU.
                let missing = list.get(found.len()).copied().unwrap_or_default();
                bail!(
                    "--gpus: GPU {missing} does not exist (CUDA finds {} of the {} GPUs listed)",
                    found.len(),
                    list.len()
                );
            }
            ("listed in --gpus", found)
        }
        None => {
            if first > 0 && first >= found.len() {
                bail!("--device cuda:{first}: only {} GPU(s) visible", found.len());
            }
            ("visible", found.into_iter().skip(first).collect())
        }
    };
    let tp = tp::choose(
        launch.tp_given.then_some(launch.args.serve.run.device.tp),
        candidates.len(),
        what,
    )?;
    Ok((tp, candidates.into_iter().take(tp).collect()))
}

/// Runs `rewind-launch` to the end of its drain.
pub fn run(launch: Launch) -> Result<()> {
    let device = launch.args.serve.run.device.device()?;
    // The directory is resolved once here (the default model's note is printed once).
    let dir = serve_cmd::model_dir(&launch.args.serve.model)?;
    let config = ModelConfig::from_dir(&dir)?;
    let (tp, gpus) = match &device {
        Device::Cpu => (launch.args.serve.run.device.tp, Vec::new()),
        Device::Cuda(ordinals) => choose_gpus(&launch, ordinals.first().copied().unwrap_or(0))?,
    };
    // `prepare` checks that the model splits over `tp` ranks (commands/backend.rs) before anything starts.
    let mut args = launch.args.serve;
    args.run.device.tp = tp;
    if let Some(g) = gpus.first() {
        args.run.device.device = format!("cuda:{}", g.ordinal);
    }
    let prepared = serve_cmd::prepare(&args, &dir)?;
    let (plan_budget, devices) = if gpus.is_empty() {
        let budget = banner::cpu_budget().map(|b| (b, "available RAM".to_string()));
        let rank = if args.rank_processes {
            "CPU worker process"
        } else {
            "CPU thread"
        };
        (budget, vec![rank.to_string(); tp])
    } else {
        let f = args.run.device.gpu_memory_fraction;
        let total: u64 = gpus.iter().map(|g| (g.total_bytes as f64 * f) as u64).sum();
        let source = format!("{} GPU(s) x --gpu-memory-fraction {f}", gpus.len());
        (Some((total, source)), gpus.iter().map(gpus::describe).collect())
    };
    let plan = match plan_budget {
        Some((budget, budget_source)) => {
            let input = banner::PlanInput {
                config: &config,
                budget,
                budget_source,
                context: prepared.context,
                spec_window: prepared.engine_config.spec.as_ref().map_or(0, |s| s.config.window),
                buffer_len: args.run.decode.buffer_len,
                act_bytes: banner::act_bytes((!gpus.is_empty()).then_some(args.run.device.dtype.as_str())),
            };
            Some((banner::memory_plan(&input)?, input.budget_source))
        }
        None => None,
    };
    let form = prepared.backend.form.name().to_string();
    let (slots, context) = (prepared.slots, prepared.context);
    run::runtime()?.block_on(async move {
        let listeners = run::Listeners::bind(&prepared.options).await?;
        let (state, options, _device) = serve_cmd::start(prepared).await.context("starting the engine")?;
        let banner = banner::Banner {
            model_dir: &dir,
            config: &config,
            served_as: state.model_name.clone(),
            tp,
            devices,
            form,
            slots,
            context,
            plan,
            api_key: state.api_keys.required(),
        };
        // The state goes to the servers whole: the engine stops once they let go of it.
        run::serve_with(state, listeners, &options, move |bound| match banner.render(bound) {
            Ok(text) => crate::output::write_stderr(&text),
            Err(e) => errln!("rewind-launch: the banner could not be written: {e}"),
        })
        .await
    })
}

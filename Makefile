# Two commands from a fresh clone:  make demo   and   make test
# Both create .venv/ (no system MPI needed: MPICH comes from the mpich wheel).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
NP ?= 4
TORCH_VERSION ?= 2.13.0

# Bytecode caches are written even where the environment asks not to (PYTHONDONTWRITEBYTECODE):
# the tests start hundreds of processes that each import ringcomm, 0.3-0.4 s faster from them.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test checks test-unit slurm warm test-mpi test-horovod test-horovod-gloo test-torch-dist test-torch-dist-all layers ruff typecheck docs gpu-test gpu-bench gpu-check \
	bench-ddp lint clean

$(BIN)/python:
	@echo "== creating $(VENV)/ and upgrading pip"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# The demo needs the package with its MPI extra and the examples' data (scikit-learn).
$(VENV)/.demo: pyproject.toml | $(BIN)/python
	@echo "== installing ringcomm with its mpi and examples extras (numpy, numba, mpich, mpi4py, scikit-learn)"
	$(BIN)/python -m pip install -q -e '.[mpi,examples]'
	touch $@

# Tests: torch first (the CPU build here), so that nothing pulls in another, CUDA-sized build.
$(VENV)/.test: pyproject.toml | $(BIN)/python
	@echo "== installing torch $(TORCH_VERSION) first (the largest download)"
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	@echo "== installing ringcomm with its test and docs extras (CuPy, NVRTC, Lightning, Accelerate, Transformers, Ray, MkDocs, ...)"
	$(BIN)/python -m pip install -q -e '.[mpi,examples,torch,test,docs]'
	@echo "== unpacking horovodrun (Horovod's source release, Python only) for tests/test_horovodrun.py"
	$(BIN)/python tests/upstream/horovodrun.py --fetch $(VENV)/horovod-src
	touch $@ $(VENV)/.demo

demo: $(VENV)/.demo
	$(BIN)/mpiexec -n $(NP) $(BIN)/python examples/train_digits.py --compression int8
	$(BIN)/mpiexec -n $(NP) $(BIN)/ringcomm-perf -b 4K -e 16M -f 4 -n 10 \
		--compression int8,topk:0.01

test: checks test-unit test-mpi test-horovod test-torch-dist

# The static checks, Slurm's install and the caches' warm-up side by side: each is one process
# (mypy alone takes 30 s from a fresh clone; Slurm's install waits on the package mirror).
checks: $(VENV)/.test
	$(MAKE) --no-print-directory -j4 --output-sync=target layers ruff typecheck docs slurm warm

# The import layers of ringcomm/ (contracts in pyproject.toml): a module imports only from
# layers below it.
layers: $(VENV)/.test
	$(BIN)/lint-imports --no-logo

# Two workers (pytest-xdist) on 2 cores: the one-process tests kept 1.1 of them busy on
# average in one process (the launchers' start-up waits, single-threaded tests): 1080-1260 s
# there, 927-979 s on two workers (168% CPU). Three took 900 s once (185%), but 1144 s in
# another run, with three tests that wait on time failing under the load. TEST_WORKERS=0
# runs them in this process. Work stealing (--dist worksteal): under xdist's default "load"
# one worker ran out of tests with 340 s of the other's queue left (the torch and framework
# jobs, collected last): 782 s, against 674 s with each worker's time within 1% of the other's.
TEST_WORKERS ?= 2

# tests/test_slurm.py runs srun and sbatch on a private one-node cluster of Slurm's own
# daemons; where they are missing and this is root on Debian, Debian's Slurm is installed
# (about 20 s); elsewhere those tests are skipped, saying so. SLURM_INSTALL=0 installs nothing.
SLURM_INSTALL ?= 1
slurm:
	@command -v slurmctld >/dev/null || [ "$(SLURM_INSTALL)" != 1 ] || [ "$$(id -u)" != 0 ] \
		|| ! command -v apt-get >/dev/null || { \
		echo "== installing Slurm (Debian's slurmctld, slurmd, slurm-client) for tests/test_slurm.py"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client >/dev/null 2>&1 \
		|| { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends \
			slurmctld slurmd slurm-client >/dev/null 2>&1; } \
		|| echo "== Slurm could not be installed: tests/test_slurm.py will be skipped"; }

# Numba's cache of ringcomm's kernels and the tests' emulated GPU library, filled once before the
# tests (tests/warm_caches.py): in a fresh clone the first jobs otherwise each compile them, all
# their processes at once. A few seconds where they are filled.
warm: $(VENV)/.test
	$(BIN)/python tests/warm_caches.py

# tests/mpi runs under mpiexec below (at one rank it mostly skips: 40 s for the few calls of
# a one-process communicator, which tests/test_api.py covers).
test-unit: $(VENV)/.test slurm warm
	$(BIN)/python -m pytest tests -q -p no:cacheprovider -n $(TEST_WORKERS) $(if $(filter 0,$(TEST_WORKERS)),,--dist worksteal) --ignore=tests/mpi

# Every file also runs at 3 ranks (an odd ring, nodes of different sizes, reduce-scatter parts
# of different lengths). At 4 ranks (four ranks on two cores: 2x slower) only what a fourth
# rank changes: the rings, compressed and dense (a ring longer than 3), the two-level allreduce
# over 2 nodes of 2, the collectives, groups split in two pairs, all_reduce against gloo's
# (where two of the ranks' bools are True), and the compiled small allreduce (whose polls end
# at once where ranks outnumber cores: the timed wait completes it). The property-based tests
# are not among them (four ranks on two cores took 35 s of them).
MPI_AT_4 := allreduce allreduce_native compression cuda_ring collectives hierarchical_mpi \
	powersgd_mpi auto_choice started_allreduce dist_all_to_all process_group_transport \
	torch_process_sets dist_ops_like_gloo fused_small
test-mpi: $(VENV)/.test warm
	$(BIN)/python tests/run_mpi.py -n 2 -- -q
	$(BIN)/python tests/run_mpi.py -n 3 -- -q
	$(BIN)/python tests/run_mpi.py -n 4 -- -q $(MPI_AT_4:%=tests/mpi/test_%.py)

# Horovod's own tests/parallel/test_torch.py against ringcomm.torch, one mpiexec job per test,
# then its examples/pytorch (pytorch_mnist, pytorch_synthetic_benchmark) with the import switched,
# under mpiexec and under horovodrun; needs HOROVOD_SOURCE=<a checkout of
# github.com/horovod/horovod> (skipped, saying so, without). test-horovod-gloo runs test_torch.py
# under horovodrun without MPI, as Horovod's own CI runs it with its Gloo controller.
test-horovod: $(VENV)/.test
	mkdir -p logs
	$(BIN)/python tests/upstream/run_horovod.py --json logs/horovod_test_torch.json
	$(BIN)/python tests/upstream/run_horovod_examples.py --json logs/horovod_examples.json

test-horovod-gloo: $(VENV)/.test
	mkdir -p logs
	$(BIN)/python tests/upstream/run_horovod.py --launcher horovodrun \
		--json logs/horovod_test_torch_horovodrun.json

# PyTorch's own distributed tests (DistributedTest, shipped in the torch wheel) on the
# "ringcomm" backend, 3 processes per test: the collectives, point-to-point, all_to_all_single,
# the object collectives and CPU DDP (no_sync among them) here (about a minute on 2 cores:
# each test's processes are forked from a server that imported torch once);
# test-torch-dist-all runs every one of them (about 2 minutes;
# results in tests/upstream/results/torch_distributed.md).
TORCH_DIST_SUBSET ?= all_reduce_sum or all_reduce_max or broadcast or barrier or all_gather or \
	send_recv_with_tag or scatter_full_group or gather_full_group or DistributedDataParallelCPU \
	or ringcomm_all_to_all or _object or grads_same_across_ranks_with_no_sync \
	or all_reduce_coalesced_sum
test-torch-dist: $(VENV)/.test
	mkdir -p logs
	$(BIN)/python tests/upstream/run_torch_distributed.py -k "$(TORCH_DIST_SUBSET)" \
		--json logs/torch_distributed.json

test-torch-dist-all: $(VENV)/.test
	$(BIN)/python tests/upstream/run_torch_distributed.py \
		--json tests/upstream/results/torch_distributed.json \
		--md tests/upstream/results/torch_distributed.md

# GPU tests and kernel benchmarks (on a machine with a CUDA GPU).
gpu-test: $(VENV)/.test
	$(BIN)/python -m pytest tests -q -p no:cacheprovider -m gpu
	$(BIN)/python tests/run_mpi.py -n 2 -n 4 -- -q -m gpu

gpu-bench: $(VENV)/.test
	$(BIN)/python bench/kernels_perf.py --json bench/results/kernels_perf.json

# The one-command GPU check (bench/GPU.md), with the Python already on the GPU machine: nothing
# is installed from the network and nothing is built (ringcomm runs from this tree). Wheels in
# .whl/ (the mpich wheel, for the MPI steps) are installed with --no-index. The report goes to
# bench/results/gpu/, or to GPU_CHECK_OUT.
GPU_PYTHON ?= python3
WHEELS ?= $(wildcard .whl)
gpu-check:
	$(GPU_PYTHON) bench/gpu_check.py $(if $(WHEELS),--wheels $(WHEELS)) \
		$(if $(GPU_CHECK_OUT),--out $(GPU_CHECK_OUT)) $(GPU_CHECK_ARGS)

bench-ddp: $(VENV)/.test
	$(BIN)/mpiexec -n 2 $(BIN)/python bench/ddp_perf.py --markdown bench/results/ddp_perf_n2.md
	$(BIN)/mpiexec -n 4 $(BIN)/python bench/ddp_perf.py --markdown bench/results/ddp_perf_n4.md

ruff: $(VENV)/.test
	$(BIN)/ruff check ringcomm tests bench examples

# mypy over ringcomm/, as [tool.mypy] in pyproject.toml configures it.
typecheck: $(VENV)/.test
	$(BIN)/mypy

# The documentation (mkdocs.yml): the README's guides and the API reference from the
# docstrings, into site/; any warning fails the build.
docs: $(VENV)/.test
	$(BIN)/mkdocs build --strict --quiet

lint: layers ruff typecheck

clean:
	rm -rf $(VENV) logs build dist *.egg-info

/* tests/test_processes.c — training across processes: rank discovery from each launcher's
   variables (set here, one process), the world check, and, when Open MPI's mpirun and mpicc
   are installed (make then builds ./train with MPI), mpirun runs of ./train against one
   process driving every rank with the same global batch: losses and weights within 1e-5 after
   5 steps for each strategy, a checkpoint written by 4 processes resumed by one, processes
   started with different flags, a world that does not fit, and a killed rank. Included by
   tests/test.c. */

/* ---- rank discovery ------------------------------------------------------------------------ */

static const char *const launcher_variables[] = {
    "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"};
#define N_LAUNCHER_VARIABLES (int)(sizeof launcher_variables / sizeof launcher_variables[0])

/* Unsets every launcher variable, then sets those of `assignments` ("A=1 B=2"). */
static void set_launcher_env(const char *assignments) {
    for (int i = 0; i < N_LAUNCHER_VARIABLES; i++) unsetenv(launcher_variables[i]);
    char copy[512];
    snprintf(copy, sizeof copy, "%s", assignments);
    for (char *item = strtok(copy, " "); item; item = strtok(NULL, " ")) {
        char *eq = strchr(item, '=');
        *eq = '\0';
        setenv(item, eq + 1, 1);
    }
}

typedef struct {
    const char *env;
    const char *launcher; /* NULL: none */
    int process, processes, local_process, local_processes, node;
} launcher_case;

static void test_launcher_env(results *r) {
    static const launcher_case cases[] = {
        {"", NULL, 0, 1, 0, 1, 0},
        {"TORCHELASTIC_RUN_ID=job7 RANK=5 WORLD_SIZE=8 LOCAL_RANK=1 LOCAL_WORLD_SIZE=4 GROUP_RANK=1",
         "torchrun", 5, 8, 1, 4, 1},
        {"SLURM_PROCID=3 SLURM_NTASKS=4 SLURM_LOCALID=1 SLURM_NODEID=1", "Slurm", 3, 4, 1, 0, 1},
        {"OMPI_COMM_WORLD_RANK=2 OMPI_COMM_WORLD_SIZE=4 OMPI_COMM_WORLD_LOCAL_RANK=0 "
         "OMPI_COMM_WORLD_LOCAL_SIZE=2", "Open MPI", 2, 4, 0, 2, 1},
        {"PMI_RANK=3 PMI_SIZE=4 MPI_LOCALRANKID=1 MPI_LOCALNRANKS=2", "MPICH", 3, 4, 1, 2, 1},
        /* torchrun first: it also runs under Slurm and mpirun */
        {"OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=2 SLURM_PROCID=1 SLURM_NTASKS=2 "
         "TORCHELASTIC_RUN_ID=x RANK=1 WORLD_SIZE=2", "torchrun", 1, 2, 0, 0, 0},
        {"OMPI_COMM_WORLD_RANK=1 OMPI_COMM_WORLD_SIZE=2 SLURM_PROCID=0 SLURM_NTASKS=2", "Slurm",
         0, 2, 0, 0, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const launcher_case *c = &cases[i];
        set_launcher_env(c->env);
        lg_launch l;
        lg_error err = {""};
        int rc = lg_launch_from_env(&l, &err);
        int same_launcher = c->launcher ? l.launcher && strcmp(l.launcher, c->launcher) == 0 : !l.launcher;
        check(r, rc == 0 && same_launcher && l.process == c->process && l.processes == c->processes &&
                     l.local_process == c->local_process && l.local_processes == c->local_processes &&
                     l.node == c->node,
              "launcher from '%s': %s, process %d of %d, local %d of %d, node %d %s", c->env,
              l.launcher ? l.launcher : "none", l.process, l.processes, l.local_process,
              l.local_processes, l.node, err.msg);
    }
    static const struct {
        const char *env, *want;
    } bad[] = {
        {"TORCHELASTIC_RUN_ID=x RANK=two WORLD_SIZE=2", "RANK='two' is not a rank"},
        {"SLURM_PROCID=4 SLURM_NTASKS=4", "SLURM_PROCID=4 is outside the world SLURM_NTASKS=4"},
        {"PMI_RANK=0", "PMI_SIZE is missing"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        set_launcher_env(bad[i].env);
        lg_launch l;
        lg_error err = {""};
        int rc = lg_launch_from_env(&l, &err);
        check(r, rc != 0 && strstr(err.msg, bad[i].want), "launcher from '%s' refused: %s",
              bad[i].env, err.msg);
    }
    set_launcher_env("");
}

static void test_launch_place(results *r) {
    static const struct {
        int process, processes, devices, nodes, first, local;
    } fits[] = {
        {0, 1, 4, 2, 0, 8}, /* no launcher: every rank */
        {3, 4, 4, 1, 3, 1}, /* a process a rank */
        {2, 4, 2, 2, 2, 1},
        {1, 2, 4, 2, 4, 4}, /* a process a node */
    };
    for (size_t i = 0; i < sizeof fits / sizeof fits[0]; i++) {
        lg_launch l;
        lg_error err = {""};
        memset(&l, 0, sizeof l);
        l.launcher = "test";
        l.process = fits[i].process;
        l.processes = fits[i].processes;
        int rc = lg_launch_place(&l, fits[i].devices, fits[i].nodes, &err);
        check(r, rc == 0 && l.first_rank == fits[i].first && l.local_ranks == fits[i].local,
              "process %d of %d, -d %d --nodes %d: ranks %d.. (%d) %s", fits[i].process,
              fits[i].processes, fits[i].devices, fits[i].nodes, l.first_rank, l.local_ranks, err.msg);
    }
    lg_launch l;
    lg_error err = {""};
    memset(&l, 0, sizeof l);
    l.launcher = "Slurm";
    l.processes = 3;
    int rc = lg_launch_place(&l, 2, 2, &err);
    check(r, rc != 0 && strstr(err.msg, "Slurm started 3 processes, but `devices 2` x `nodes 2` is 4 ranks"),
          "3 processes for -d 2 --nodes 2 refused: %s", err.msg);
}

/* ---- the plan's MPI buffers ------------------------------------------------------------------ */

/* The processes (of `processes`, `per` ranks each) holding members of the group first + m
   stride, as bits; the group needs MPI when more than one does. */
static unsigned group_processes(int first, int stride, int count, int per) {
    unsigned bits = 0;
    for (int m = 0; m < count; m++) bits |= 1u << ((first + m * stride) / per);
    return bits;
}

static int bit_count(unsigned bits) {
    int n = 0;
    for (; bits; bits &= bits - 1) n++;
    return n;
}

/* Every layout of the mpirun tests: each process holds one MPI buffer region of 16 MiB
   (send and receive sums of 2^20 doubles) for each group that spans processes and has
   members in it, on one of its own ranks, counted here from the groups' members; one process
   driving every rank holds none. */
static void test_mpi_plan(results *r) {
    static const struct {
        const char *name;
        int devices, nodes, processes;
        lg_strategy strategy;
    } layouts[] = {
        {"full-shard -d 4, 4 processes", 4, 1, 4, LG_STRATEGY_FULL_SHARD},
        {"no-shard -d 4, 4 processes", 4, 1, 4, LG_STRATEGY_NO_SHARD},
        {"shard-grad-op -d 2, 2 processes", 2, 1, 2, LG_STRATEGY_SHARD_GRAD_OP},
        {"hybrid 2 x 2, 4 processes", 2, 2, 4, LG_STRATEGY_HYBRID_SHARD},
        {"hybrid 2 x 2, a process a node", 2, 2, 2, LG_STRATEGY_HYBRID_SHARD},
        {"full-shard 2 x 2, a process a node", 2, 2, 2, LG_STRATEGY_FULL_SHARD},
        {"full-shard -d 4, one process", 4, 1, 1, LG_STRATEGY_FULL_SHARD},
    };
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "pythia-14m")) return;
    for (size_t k = 0; k < sizeof layouts / sizeof layouts[0]; k++) {
        lg_args a;
        lg_args_default(&a);
        a.devices = layouts[k].devices;
        a.nodes = layouts[k].nodes;
        a.processes = layouts[k].processes;
        a.strategy = layouts[k].strategy;
        a.global_batch_size = a.devices * a.nodes;
        lg_plan_spec spec;
        lg_plan plan;
        lg_error err = {""};
        lg_plan_spec_from_args(&spec, &a, 16);
        if (lg_plan_make(&plan, &cfg, &spec, &err) != 0) {
            check(r, 0, "plan of %s: %s", layouts[k].name, err.msg);
            continue;
        }
        int n = plan.n_ranks, per = n / a.processes, S = plan.sharding.shard_ranks;
        int R = plan.sharding.replicas, want[LG_MAX_RANKS] = {0}, held[LG_MAX_RANKS] = {0};
        unsigned groups[2 * LG_MAX_RANKS + 1]; /* each group's processes */
        int n_groups = 0;
        for (int q = 0; q < R && S > 1; q++) groups[n_groups++] = group_processes(q * S, 1, S, per);
        for (int i = 0; i < S && R > 1; i++) groups[n_groups++] = group_processes(i, S, R, per);
        groups[n_groups++] = group_processes(0, 1, n, per); /* all ranks */
        for (int j = 0; j < n_groups; j++)
            for (int p = 0; p < a.processes; p++)
                want[p] += bit_count(groups[j]) > 1 && (groups[j] >> p & 1);
        int sizes_ok = 1;
        size_t host_most = 0;
        for (int rank = 0; rank < n; rank++)
            for (int i = 0; i < plan.ranks[rank].n_regions; i++) {
                const lg_region *x = &plan.ranks[rank].regions[i];
                if (strncmp(x->name, "mpi.", 4) != 0) continue;
                held[rank / per]++;
                sizes_ok &= x->bytes == (size_t)16 << 20 && x->pool == LG_POOL_HOST;
            }
        int same = 1;
        for (int p = 0; p < a.processes; p++) same &= held[p] == want[p];
        for (int rank = 0; rank < n; rank++)
            if (plan.ranks[rank].pool_bytes[LG_POOL_HOST] > host_most)
                host_most = plan.ranks[rank].pool_bytes[LG_POOL_HOST];
        check(r, same && sizes_ok && host_most == lg_plan_bytes(&plan, LG_POOL_HOST),
              "plan of %s: process 0 holds %d MPI buffer regions of 16 MiB (its groups across "
              "processes: %d), the last %d (%d)", layouts[k].name, held[0], want[0],
              held[a.processes - 1], want[a.processes - 1]);
        lg_plan_free(&plan);
    }
}

/* A sharded checkpoint's extra memory is one unit, in the plan: saving a full-shard run of 2
   ranks (pythia-14m, bf16-mixed AdamW: master weights and two moments) allocates nothing larger
   than the safetensors writer's buffer of one tensor in fp32 (a whole buffer of the model's
   weights or state would be larger); the unit's state goes through the plan's
   checkpoint.gather on rank 0. */
static void test_checkpoint_memory(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "pythia-14m")) return;
    lg_args a;
    lg_args_default(&a);
    a.devices = 2;
    a.strategy = LG_STRATEGY_FULL_SHARD;
    a.micro_batch_size = 1;
    a.global_batch_size = 2;
    lg_trainer tr;
    lg_error err = {""};
    if (lg_trainer_create(&tr, &cfg, &a, 16, &err) != 0) {
        check(r, 0, "full-shard trainer: %s", err.msg);
        return;
    }
    const lg_shard_layout *sl = &tr.plan.shards;
    size_t unit = 0, at[3];
    for (int u = 0; u < sl->n_units; u++)
        unit = sl->unit_offset[u + 1] - sl->unit_offset[u] > unit ? sl->unit_offset[u + 1] - sl->unit_offset[u] : unit;
    size_t tensor = 0; /* the largest tensor: the writer's buffer holds one in fp32 */
    for (int i = 0; i < tr.ranks[0].model.param_table.n_tensors; i++)
        tensor = tr.ranks[0].model.param_table.tensors[i].count > tensor ? tr.ranks[0].model.param_table.tensors[i].count : tensor;
    size_t planned = lg_checkpoint_unit_layout(&tr.plan, at);
    const lg_region *x = lg_plan_find(&tr.plan.ranks[0], "checkpoint.gather");
    test_allocations.n = 0;
    test_allocations.counting = 1;
    int rc = system("rm -rf build/ckpt-memory") == 0 ? 0 : -1;
    if (rc == 0) rc = lg_checkpoint_save(&tr, NULL, 1, "build/ckpt-memory", &err);
    test_allocations.counting = 0;
    size_t largest = 0;
    for (int i = 0; i < test_allocations.n; i++)
        largest = test_allocations.sizes[i] > largest ? test_allocations.sizes[i] : largest;
    char a_[32], b_[32], c_[32];
    check(r, rc == 0 && x && x->bytes >= planned && planned >= 3 * 4 * unit && largest <= 4 * tensor &&
                 x == lg_plan_find(&tr.plan.ranks[0], "checkpoint.gather") &&
                 !lg_plan_find(&tr.plan.ranks[1], "checkpoint.gather"),
          "full-shard checkpoint of 2 ranks: the largest allocation while saving is %s, the "
          "writer's one tensor in fp32 (%s); the unit's state is planned on rank 0 "
          "(checkpoint.gather %s) %s",
          lg_format_bytes(largest, a_, sizeof a_), lg_format_bytes(4 * tensor, b_, sizeof b_),
          lg_format_bytes(x ? x->bytes : 0, c_, sizeof c_), err.msg);
    lg_trainer_free(&tr);
}

/* ---- mpirun runs of ./train ------------------------------------------------------------------ */

#define MPIRUN "OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 " \
               "mpirun --oversubscribe "
/* short runs of the built-in task in fp32: 5 steps of 32 samples */
#define RUN_FLAGS "--max-steps 5 -p 32-true -g 32 -b 4 --eval-iters 2 --eval-every 0 " \
                  "--sample-tokens 1 --lr 3e-3 --warmup-steps 2"

/* Runs cmd (output into out, at most cap - 1 bytes); its exit code, -1 when it did not exit. */
static int run_captured(const char *cmd, char *out, size_t cap) {
    char full[2048], chunk[512]; /* cap is larger (the callers' buffers are kilobytes) */
    snprintf(full, sizeof full, "%s 2>&1", cmd);
    FILE *p = popen(full, "r");
    size_t n = 0, got;
    /* read to the end (a writer blocked on a full pipe would never exit), keeping the last
       cap - 1 bytes: mpirun gives its ranks a terminal, where the progress line is rewritten
       every step */
    while (p && (got = fread(chunk, 1, sizeof chunk, p)) > 0) {
        if (n + got > cap - 1) {
            size_t drop = n + got - (cap - 1);
            memmove(out, out + drop, n - drop);
            n -= drop;
        }
        memcpy(out + n, chunk, got);
        n += got;
    }
    out[n] = '\0';
    int status = p ? pclose(p) : -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* The "loss" and "val_loss" numbers of a --log file, in order; how many (at most cap). */
static int read_log_losses(const char *path, double *losses, int cap) {
    FILE *f = fopen(path, "r");
    char line[512];
    int n = 0;
    while (f && n < cap && fgets(line, sizeof line, f)) {
        const char *at = strstr(line, "loss\":");
        if (at) losses[n++] = atof(at + 6);
    }
    if (f) fclose(f);
    return n;
}

/* max |a - b| over the fp32 tensors of two model.safetensors, relative to max |b| (at least
   1); -1 when they cannot be read or hold other tensors. */
static double safetensors_difference(const char *path_a, const char *path_b) {
    lg_st_file a, b;
    lg_error err;
    double diff = -1, scale = 1;
    if (lg_st_open(&a, path_a, &err) != 0) return -1;
    if (lg_st_open(&b, path_b, &err) != 0) {
        lg_st_close(&a);
        return -1;
    }
    int same = a.n_tensors == b.n_tensors && a.n_tensors > 0;
    for (int i = 0; same && i < a.n_tensors; i++) {
        const lg_st_tensor *ta = &a.tensors[i], *tb = lg_st_find(&b, ta->name);
        same = tb && ta->dtype == LG_ST_F32 && tb->dtype == LG_ST_F32 &&
               ta->end - ta->begin == tb->end - tb->begin;
        size_t count = same ? (size_t)(ta->end - ta->begin) / sizeof(float) : 0;
        float *va = (float *)malloc(count * sizeof(float) + 1), *vb = (float *)malloc(count * sizeof(float) + 1);
        same = same && va && vb && lg_st_read(&a, ta, va, &err) == 0 && lg_st_read(&b, tb, vb, &err) == 0;
        for (size_t k = 0; same && k < count; k++) {
            diff = fmax(diff, fabs((double)va[k] - vb[k]));
            scale = fmax(scale, fabs((double)vb[k]));
        }
        free(va);
        free(vb);
    }
    lg_st_close(&a);
    lg_st_close(&b);
    return same ? diff / scale : -1;
}

/* The largest difference of two runs' losses (both logs with the same number, >= want). */
static double log_difference(const char *path_a, const char *path_b, int want, int *count) {
    double a[64], b[64], diff = 0;
    int n = read_log_losses(path_a, a, 64), m = read_log_losses(path_b, b, 64);
    *count = n;
    if (n != m || n < want) return 1e9;
    for (int i = 0; i < n; i++) diff = fmax(diff, fabs(a[i] - b[i]));
    return diff;
}

typedef struct {
    const char *name;     /* the run's directory under build/mpi */
    const char *layout;   /* -d, --nodes, --strategy */
    int processes;
} process_run;

/* One process driving every rank, then `processes` processes under mpirun, same flags. */
static void check_processes_match(results *r, const process_run *run) {
    char cmd[1024], out[8192];
    snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=1 ./train %s " RUN_FLAGS " --log build/mpi/%s-one.log "
             "--out build/mpi/%s-one", run->layout, run->name, run->name);
    int rc_one = run_captured(cmd, out, sizeof out);
    snprintf(cmd, sizeof cmd, MPIRUN "-np %d ./train %s " RUN_FLAGS " --save-every 3 "
             "--log build/mpi/%s-many.log --out build/mpi/%s-many", run->processes, run->layout,
             run->name, run->name);
    int rc_many = run_captured(cmd, out, sizeof out);
    char a[256], b[256];
    snprintf(a, sizeof a, "build/mpi/%s-many/step-5/model.safetensors", run->name);
    snprintf(b, sizeof b, "build/mpi/%s-one/step-5/model.safetensors", run->name);
    double weights = safetensors_difference(a, b);
    snprintf(a, sizeof a, "build/mpi/%s-many.log", run->name);
    snprintf(b, sizeof b, "build/mpi/%s-one.log", run->name);
    int n = 0;
    double losses = log_difference(a, b, 7, &n);
    check(r, rc_one == 0 && rc_many == 0 && weights >= 0 && weights < 1e-5 && losses < 1e-5,
          "mpirun -np %d ./train %s = one process: %d losses within %.1e, weights within %.1e "
          "(exit %d, %d)%s%.300s", run->processes, run->layout, n, losses, weights, rc_one, rc_many,
          rc_many ? ": " : "", rc_many ? out : "");
}

/* The checkpoint that 4 processes wrote after step 3 continues in one process with the losses
   of the uninterrupted run's steps 4 and 5. */
static void check_resume_in_one_process(results *r, const process_run *run) {
    char cmd[1024], out[8192], path[256], ref[256];
    snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=1 ./train %s " RUN_FLAGS " --resume "
             "build/mpi/%s-many/step-3 --log build/mpi/%s-resumed.log", run->layout, run->name,
             run->name);
    int rc = run_captured(cmd, out, sizeof out);
    double resumed[16], whole[16];
    snprintf(path, sizeof path, "build/mpi/%s-resumed.log", run->name);
    snprintf(ref, sizeof ref, "build/mpi/%s-one.log", run->name);
    int n = read_log_losses(path, resumed, 16), m = read_log_losses(ref, whole, 16);
    /* resumed: val, steps 4 and 5, val; whole: val, steps 1..5, val */
    double diff = n == 4 && m == 7 ? fmax(fabs(resumed[1] - whole[4]), fabs(resumed[2] - whole[5])) : 1e9;
    check(r, rc == 0 && diff < 1e-5,
          "step-3 of mpirun -np %d ./train %s resumed in one process: steps 4-5 within %.1e of "
          "the uninterrupted run (exit %d)", run->processes, run->layout, diff, rc);
}

/* Start-up: no process ends alone while the others wait for it, and a stopped rank is named
   whether it stopped between collectives or inside one. */
static void test_mpirun_start_up(results *r) {
    char out[32768]; /* (the usage text whole) */
    double start = lg_time_ms();
    int rc = run_captured(MPIRUN "-np 1 ./train -d 2 --plan : -np 1 ./train -d 2 " RUN_FLAGS, out, sizeof out);
    double seconds = (lg_time_ms() - start) / 1e3;
    /* (rank 0's abort may end rank 1 before it says so: either one's line) */
    check(r, rc == 2 && seconds < 60 && strstr(out, "started with '--max-steps 5' where process 0 has '--plan'"),
          "--plan given to process 0 alone: every process refused it after %.1f s (exit %d), "
          "naming the flag", seconds, rc);
    rc = run_captured(MPIRUN "-np 1 ./train -d 2 --max-steps 0 : -np 1 ./train -d 2 --help", out, sizeof out);
    check(r, rc == 2 && strstr(out, "started with '--help' where process 0 has '--max-steps 0'"),
          "--help given to process 1 alone: refused (exit %d), naming it", rc);
    rc = run_captured(MPIRUN "-np 2 ./train -d 2 --help", out, sizeof out);
    const char *usage = strstr(out, "usage: ");
    check(r, rc == 0 && usage && !strstr(usage + 1, "usage: "),
          "--help on every process: exit %d, the usage printed once", rc);
    /* a process that never joins MPI (it exits 0 first): the other's watchdog ends the job */
    start = lg_time_ms();
    rc = run_captured(MPIRUN "-np 1 true : -np 1 ./train -d 2 --max-steps 0 --dist-timeout 2", out, sizeof out);
    seconds = (lg_time_ms() - start) / 1e3;
    check(r, rc == 2 && seconds >= 2 && seconds < 60 &&
                 strstr(out, "rank 1: MPI did not start within --dist-timeout 2 s: all 2 processes"),
          "process 0 exited before MPI started: rank 1 stopped after %.1f s (exit %d), saying so",
          seconds, rc);
    /* rank 1 SIGSTOPped once rank 0 logs steps: before a collective (not arrived) or inside
       one (silent); either way rank 0 names it */
    rc = run_captured("rm -f build/mpi/stop.log; (" MPIRUN "-np 2 sh -c 'echo $$ > build/mpi/pid.$OMPI_COMM_WORLD_RANK; "
                      "exec ./train -d 2 -p 32-true --max-steps 100000 --dist-timeout 2 --log build/mpi/stop.log' & "
                      "until grep -q loss build/mpi/stop.log 2>/dev/null; do sleep 0.1; done; sleep 0.5; "
                      "kill -STOP $(cat build/mpi/pid.1); wait $!)", out, sizeof out);
    check(r, rc != 0 && (strstr(out, "within --dist-timeout 2 s: not arrived (hung or stopped): rank 1;") ||
                         strstr(out, "within --dist-timeout 2 s: arrived, then stopped inside it: rank 1 (silent")),
          "rank 1 stopped (SIGSTOP) mid-run: exit %d, rank 0 naming rank 1", rc);
}

static void test_mpirun(results *r) {
    char out[8192];
    if (system("command -v mpirun >/dev/null 2>&1 && ldd ./train | grep -q libmpi") != 0) {
        printf("  (mpirun not found or ./train built without MPI: runs across processes not "
               "checked; apt-get install openmpi-bin libopenmpi-dev, then make cpu)\n");
        return;
    }
    if (system("rm -rf build/mpi && mkdir -p build/mpi") != 0) printf("    cannot clear build/mpi\n");
    static const process_run runs[] = {
        {"full2", "-d 2 --strategy full-shard", 2},
        {"full4", "-d 4 --strategy full-shard", 4},
        {"grad2", "-d 2 --strategy shard-grad-op", 2},
        {"grad4", "-d 4 --strategy shard-grad-op", 4},
        {"ddp2", "-d 2 --strategy no-shard", 2},
        {"ddp4", "-d 4 --strategy no-shard", 4},
        {"hybrid4", "-d 2 --nodes 2 --strategy hybrid-shard", 4},
        {"hybrid2", "-d 2 --nodes 2 --strategy hybrid-shard", 2}, /* a process a node */
        /* a process a node, its 2 ranks members of groups that span processes */
        {"fullnode", "-d 2 --nodes 2 --strategy full-shard", 2},
        {"ddpnode", "-d 2 --nodes 2 --strategy no-shard", 2},
        /* Sophia's labels drawn by global place, its Hessian pass's collectives */
        {"sophia2", "-d 2 --strategy full-shard -o sophia --hessian-interval 2", 2},
        /* QLoRA: the frozen NF4 base sharded, its units gathered across processes */
        {"qlora2", "-d 2 --strategy full-shard --lora-r 2 --quantize nf4", 2},
        /* --offload weights: each process streams its pieces from host memory, then gathers */
        {"streamed2", "-d 2 --strategy full-shard --offload state,weights", 2},
        {"qlorastreamed2", "-d 2 --strategy full-shard --lora-r 2 --quantize nf4 --offload state,weights", 2},
    };
    int rc = run_captured(MPIRUN "-np 2 ./train -d 2 --plan", out, sizeof out);
    int table = rc == 0 && strstr(out, "processes: 2, 1 rank each") && strstr(out, "largest mpi.shard 16.0 MiB");
    rc |= run_captured(MPIRUN "-np 2 ./train -d 2 --plan=json", out, sizeof out);
    const char *shard = strstr(out, "{\"name\":\"mpi.shard\",\"group\":\"communication\",\"pool\":\"host\","
                                    "\"dtype\":\"u8\",\"count\":16777216");
    const char *all = shard ? strstr(shard + 1, "{\"name\":\"mpi.all\",\"group\":\"communication\","
                                                "\"pool\":\"host\",\"dtype\":\"u8\",\"count\":16777216") : NULL;
    check(r, rc == 0 && table && all && strstr(all + 1, "\"name\":\"mpi.shard\"") &&
                 strstr(all, "\"name\":\"checkpoint.gather\""),
          "mpirun -np 2 ./train -d 2 --plan (and =json): each rank's host pool holds 16 MiB of MPI "
          "buffers for its shard group and for all ranks, and a checkpoint unit (exit %d)", rc);
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) check_processes_match(r, &runs[i]);
    check_resume_in_one_process(r, &runs[1]);
    check_resume_in_one_process(r, &runs[5]);

    rc = run_captured(MPIRUN "-np 3 ./train -d 2 " RUN_FLAGS, out, sizeof out);
    /* (mpirun stops the others when the first exits: any one of them may be the one to say it) */
    check(r, rc == 2 && strstr(out, ": train: Open MPI started 3 processes, but -d 2 x --nodes 1 is 2 ranks") &&
                 strstr(out, "rank "),
          "mpirun -np 3 ./train -d 2: exit %d naming the numbers", rc);
    /* Slurm's variables in a batch script, the process not started by srun: MPI sees one */
    expect_program(r, "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 SLURM_PROCID=0 "
                   "SLURM_NTASKS=2 ./train", "-d 2 --max-steps 0", 2,
                   "rank 0: train: Slurm says process 0 of 2, MPI says 0 of 1");
    rc = run_captured(MPIRUN "-np 1 ./train -d 2 " RUN_FLAGS " --lr 0.01 : -np 1 ./train -d 2 "
                      RUN_FLAGS " --lr 0.02", out, sizeof out);
    check(r, rc == 2 && strstr(out, "started with '--lr 0.02' where process 0 has '--lr 0.01'"),
          "processes started with --lr 0.01 and 0.02: refused (exit %d), naming the flag", rc);
    rc = run_captured(MPIRUN "-np 1 ./train -d 2 " RUN_FLAGS " : -np 1 ./train -d 2 " RUN_FLAGS
                      " --seed 5", out, sizeof out);
    /* (the flags are compared before the data is read: --seed 5 is one item more; rank 0's
       abort may end rank 1 before it says so) */
    check(r, rc == 2 && (strstr(out, "; the next here is '--seed 5')") ||
                         strstr(out, "; the next there is '--seed 5')")),
          "a process started with one more flag: refused (exit %d), naming it", rc);
    /* rank 1 killed mid-run: mpirun stops rank 0 and names rank 1 */
    double start = lg_time_ms();
    rc = run_captured(MPIRUN "-np 1 ./train -d 2 -p 32-true --max-steps 100000 : -np 1 timeout -s KILL 3 "
                      "./train -d 2 -p 32-true --max-steps 100000", out, sizeof out);
    double seconds = (lg_time_ms() - start) / 1e3;
    check(r, rc != 0 && seconds < 60 && strstr(out, "process rank 1") && strstr(out, "signal 9"),
          "rank 1 killed mid-run: every process stopped after %.1f s (exit %d), rank 1 named",
          seconds, rc);
    /* a hung process (test-only LG_TEST_HANG=P:S: process P sleeps an hour before step S):
       rank 0 stops the job after --dist-timeout, naming rank 1; when rank 0 hangs, rank 1
       stops it a grace later, naming rank 0 as the likely one */
    start = lg_time_ms();
    rc = run_captured("LG_TEST_HANG=1:2 " MPIRUN "-np 2 ./train -d 2 -p 32-true --max-steps 1000 "
                      "--dist-timeout 3", out, sizeof out);
    seconds = (lg_time_ms() - start) / 1e3;
    check(r, rc != 0 && seconds >= 3 && seconds < 60 &&
                 strstr(out, "within --dist-timeout 3 s: not arrived (hung or stopped): rank 1;"),
          "rank 1 hung at step 2, --dist-timeout 3: the job ended after %.1f s (exit %d), rank 0 "
          "naming rank 1%s%.300s", seconds, rc, rc ? "" : ": ", rc ? "" : out);
    start = lg_time_ms();
    rc = run_captured("LG_TEST_HANG=0:2 " MPIRUN "-np 2 ./train -d 2 -p 32-true --max-steps 1000 "
                      "--dist-timeout 2", out, sizeof out);
    seconds = (lg_time_ms() - start) / 1e3;
    check(r, rc != 0 && seconds >= 4 && seconds < 60 &&
                 strstr(out, "rank 1: the ") && strstr(out, "and rank 0, which names the late, did "
                                                        "not stop the job: it may be the one that hangs"),
          "rank 0 hung at step 2, --dist-timeout 2: rank 1 ended the job after %.1f s (exit %d), "
          "naming rank 0", seconds, rc);
    test_mpirun_start_up(r);
}

/* ---- the rendezvous (GPU processes without MPI): TCP and a shared file ------------------------ */

#define RENDEZVOUS_ID_BYTES 128 /* NCCL's unique id */

/* A port nothing listens on now (the kernel's pick). */
static int free_port(void) {
    struct sockaddr_in a;
    socklen_t len = sizeof a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    int fd = socket(AF_INET, SOCK_STREAM, 0), port = 0;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0) close(fd);
    return port;
}

/* Processes 1..started-1 forked, process 0 here after delay_ms, all of `processes`. A child
   exits 0 when it got process 0's id, 10 when it failed with an error holding child_error, else
   1. Returns how many children ended as wanted (want_ok: 0, else 10); process 0's outcome in
   root_rc and root_err. */
static int run_rendezvous(const char *init, int started, int processes, double timeout_s,
                          int delay_ms, int want_ok, const char *child_error, int *root_rc,
                          lg_error *root_err) {
    unsigned char id[RENDEZVOUS_ID_BYTES];
    for (int i = 0; i < RENDEZVOUS_ID_BYTES; i++) id[i] = (unsigned char)(i * 37 + 11);
    pid_t children[LG_MAX_RANKS];
    fflush(stdout);
    for (int p = 1; p < started; p++) {
        children[p] = fork();
        if (children[p] != 0) continue;
        unsigned char got[RENDEZVOUS_ID_BYTES] = {0};
        lg_error err = {""};
        int rc = lg_rendezvous(init, p, processes, got, sizeof got, timeout_s, &err);
        if (rc == 0) _exit(memcmp(got, id, sizeof id) == 0 ? 0 : 1);
        _exit(child_error && strstr(err.msg, child_error) ? 10 : 1);
    }
    lg_sleep_ms(delay_ms);
    root_err->msg[0] = '\0';
    *root_rc = lg_rendezvous(init, 0, processes, id, sizeof id, timeout_s, root_err);
    int as_wanted = 0;
    for (int p = 1; p < started; p++) {
        int status = 0;
        waitpid(children[p], &status, 0);
        as_wanted += WIFEXITED(status) && WEXITSTATUS(status) == (want_ok ? 0 : 10);
    }
    return as_wanted;
}

static void test_rendezvous(results *r) {
    char tcp[64], file[] = "file://build/rendezvous/id";
    int rc;
    lg_error err;
    if (system("rm -rf build/rendezvous && mkdir -p build/rendezvous") != 0) printf("    cannot clear build/rendezvous\n");
    snprintf(tcp, sizeof tcp, "tcp://127.0.0.1:%d", free_port());
    int ok = run_rendezvous(tcp, 4, 4, 20, 200, 1, NULL, &rc, &err);
    check(r, rc == 0 && ok == 3, "rendezvous %s: 4 processes, 3 got process 0's id %s", tcp, err.msg);
    /* an earlier run's files: a published id naming processes 1..3 and their announcements */
    FILE *stale = fopen("build/rendezvous/id", "w");
    if (stale) {
        fprintf(stale, "litgpt-rendezvous 4\n1 1\n2 3\n3 5\nid ");
        for (int i = 0; i < RENDEZVOUS_ID_BYTES; i++) fprintf(stale, "ee");
        fprintf(stale, "\n");
        fclose(stale);
    }
    for (int p = 1; p < 4; p++) {
        char name[64];
        snprintf(name, sizeof name, "build/rendezvous/id.%d", p);
        if ((stale = fopen(name, "w"))) { fprintf(stale, "%x done\n", 2 * p - 1); fclose(stale); }
    }
    ok = run_rendezvous(file, 4, 4, 20, 300, 1, NULL, &rc, &err);
    check(r, rc == 0 && ok == 3, "rendezvous %s over an earlier run's files: 3 got the new id %s",
          file, err.msg);
    snprintf(tcp, sizeof tcp, "tcp://127.0.0.1:%d", free_port());
    ok = run_rendezvous(tcp, 3, 4, 1.5, 0, 0, "process 0 did not send the id", &rc, &err);
    check(r, rc != 0 && strstr(err.msg, "process 3 of 4 did not come") && ok == 2,
          "rendezvous %s, process 3 missing: every process stops after 1.5 s: %s", tcp, err.msg);
    ok = run_rendezvous(file, 3, 4, 1.5, 0, 0, "process 0 did not publish", &rc, &err);
    check(r, rc != 0 && strstr(err.msg, "process 3 of 4 never announced itself") && ok == 2,
          "rendezvous %s, process 3 missing: every process stops after 1.5 s: %s", file, err.msg);
    rc = lg_rendezvous("tcp://127.0.0.1:1", 1, 2, err.msg, 8, 0.3, &err);
    check(r, rc != 0 && strstr(err.msg, "cannot reach process 0"), "rendezvous with nobody listening: %s", err.msg);
}

/* The start-up check without MPI (the CUDA build's): process 0's flags reach 3 others over the
   rendezvous; process 2, started with another --lr, and process 3, with one more flag, refuse
   naming the flag; process 1 agrees. Returns how many processes did as wanted (4: all). */
static int run_same_check(const char *init) {
    static const char *const flags[] = {"-d 4", "--lr 0.01", "data (built-in)"};
    static const char *const other_lr[] = {"-d 4", "--lr 0.02", "data (built-in)"};
    static const char *const one_more[] = {"-d 4", "--lr 0.01", "data (built-in)", "--seed 5"};
    pid_t children[4];
    fflush(stdout);
    for (int p = 1; p < 4; p++) {
        if ((children[p] = fork()) != 0) continue;
        lg_launch l;
        memset(&l, 0, sizeof l);
        l.launcher = "test";
        l.process = p;
        l.processes = 4;
        l.dist_timeout = 20;
        snprintf(l.dist_init, sizeof l.dist_init, "%s", init);
        lg_error err = {""};
        int rc = lg_launch_same(&l, p == 1 ? flags : p == 2 ? other_lr : one_more, p == 3 ? 4 : 3, &err);
        if (p == 1) _exit(rc == 0 ? 0 : 1);
        _exit(rc != 0 && strstr(err.msg, p == 2 ? "started with '--lr 0.02' where process 0 has '--lr 0.01'"
                                                : "more flags and data items than process 0 ('--seed 5'")
                  ? 0 : 1);
    }
    lg_launch l;
    memset(&l, 0, sizeof l);
    l.launcher = "test";
    l.processes = 4;
    l.dist_timeout = 20;
    snprintf(l.dist_init, sizeof l.dist_init, "%s", init);
    lg_error err = {""};
    int as_wanted = lg_launch_same(&l, flags, 3, &err) == 0;
    for (int p = 1; p < 4; p++) {
        int status = 0;
        waitpid(children[p], &status, 0);
        as_wanted += WIFEXITED(status) && WEXITSTATUS(status) == 0;
    }
    return as_wanted;
}

static void test_same_without_mpi(results *r) {
    char tcp[64];
    snprintf(tcp, sizeof tcp, "tcp://127.0.0.1:%d", free_port());
    check(r, run_same_check(tcp) == 4, "start-up check over the rendezvous (%s, no MPI): a "
          "different --lr and one more flag refused naming them, the same flags pass", tcp);
    check(r, run_same_check("file://build/rendezvous/same") == 4, "start-up check over the "
          "rendezvous (file://, no MPI): a different --lr and one more flag refused naming them");
}

/* The flags of several processes, and a launcher without MPI for CPU ranks. */
static void test_process_flags(results *r) {
    expect_cli(r, "--dist-init foo", 2, "--dist-init: 'foo' is not tcp://HOST:PORT or file://PATH");
    expect_cli(r, "--dist-timeout 0", 2, "--dist-timeout must be more than 0 seconds");
    expect_cli(r, "--dist-init", 2, "--dist-init needs a value");
    expect_program(r, "TORCHELASTIC_RUN_ID=t RANK=0 WORLD_SIZE=3 ./train", "-d 2 --max-steps 0", 2,
                   "rank 0: train: torchrun started 3 processes, but -d 2 x --nodes 1 is 2 ranks");
    expect_program(r, "TORCHELASTIC_RUN_ID=t RANK=1 WORLD_SIZE=2 ./train", "-d 2 --max-steps 0", 1,
                   "rank 1: train: CPU ranks in several processes exchange over MPI");
}

static void test_processes(results *r) {
    test_launcher_env(r);
    test_launch_place(r);
    test_mpi_plan(r);
    test_checkpoint_memory(r);
    test_process_flags(r);
    test_rendezvous(r);
    test_same_without_mpi(r);
    test_mpirun(r);
}

/* Run under the QEMU syscall allow-list (tests/aenv_vm/vm/test_syscall_filter.py): tries
 * calls the list allows and calls it refuses, and prints "name=errno" for each (0: it ran). */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/sched.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <termios.h>
#include <unistd.h>

static void report(const char *name, long rc) { printf("%s=%d\n", name, rc < 0 ? errno : 0); }

static void *thread_main(void *arg) { return arg; }

/* a raw clone that made a process: the child leaves at once */
static long raw_clone(unsigned long flags) {
    long rc = syscall(SYS_clone, flags, 0, 0, 0, 0);
    if (rc == 0) _exit(0);
    return rc;
}

int main(void) {
    long rc;
    int fd;
    struct termios t;
    pthread_t th;
    struct clone_args ca = {0};

    /* allowed */
    fd = socket(AF_UNIX, SOCK_STREAM, 0); report("socket_unix", fd); if (fd >= 0) close(fd);
    fd = socket(AF_INET, SOCK_DGRAM, 0); report("socket_inet", fd); if (fd >= 0) close(fd);
    rc = pthread_create(&th, NULL, thread_main, NULL);
    if (rc == 0) pthread_join(th, NULL); else errno = (int)rc;
    report("thread", rc == 0 ? 0 : -1);
    report("prctl_set_name", prctl(PR_SET_NAME, "probe", 0, 0, 0));
    /* refused: not listed (ENOSYS) */
    report("ptrace", ptrace(PTRACE_PEEKUSER, getppid(), 0, 0));
    report("unshare", unshare(CLONE_NEWNS));
    report("bpf", syscall(SYS_bpf, 0, 0, 0));
    report("process_vm_readv", syscall(SYS_process_vm_readv, getppid(), 0, 0, 0, 0, 0));
    report("io_uring_setup", syscall(SYS_io_uring_setup, 8, 0));
    ca.flags = CLONE_NEWNS; ca.exit_signal = SIGCHLD;
    rc = syscall(SYS_clone3, &ca, sizeof ca);
    if (rc == 0) _exit(0);
    report("clone3", rc);
    report("kill", kill(getppid(), 0));
    report("setsid", setsid());
    /* refused by a rule's arguments */
    report("socket_netlink", socket(AF_NETLINK, SOCK_RAW, 0));
    report("socket_packet", socket(AF_PACKET, SOCK_RAW, 0));
    report("socket_alg", socket(AF_ALG, SOCK_SEQPACKET, 0));
    report("clone_process", raw_clone(SIGCHLD));
    report("clone_userns", raw_clone(SIGCHLD | CLONE_NEWUSER));
    report("ioctl_tcgets", ioctl(1, TCGETS, &t));
    report("prctl_dumpable", prctl(PR_SET_DUMPABLE, 1, 0, 0, 0));
    fflush(stdout);
    return 0;
}

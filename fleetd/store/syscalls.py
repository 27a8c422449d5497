"""Linux syscall numbers as names, so that a ``syscall`` row reads ``futex`` or ``read``.

The tracer stores the raw number (``a0`` of a ``syscall`` row); numbers are per
architecture, and the recordings fleetd makes come from x86_64 hosts, whose table this
is (from the kernel's ``asm/unistd_64.h``). Sleeps the program asked for are listed
separately: their time is the program's choice, not latency.
"""

from __future__ import annotations

# The kernel's table, a line for each run of consecutive numbers: the run's first number,
# then its names in number order (335-423 are not assigned on x86_64). Written as text,
# not as a dict literal, so that 362 entries do not each repeat a number and quotes.
_TABLE = """
0 read write open close stat fstat lstat poll lseek mmap mprotect munmap brk
13 rt_sigaction rt_sigprocmask rt_sigreturn ioctl pread64 pwrite64 readv writev
21 access pipe select sched_yield mremap msync mincore madvise shmget shmat shmctl
32 dup dup2 pause nanosleep getitimer alarm setitimer getpid sendfile socket
42 connect accept sendto recvfrom sendmsg recvmsg shutdown bind listen getsockname
52 getpeername socketpair setsockopt getsockopt clone fork vfork execve exit wait4
62 kill uname semget semop semctl shmdt msgget msgsnd msgrcv msgctl fcntl flock
74 fsync fdatasync truncate ftruncate getdents getcwd chdir fchdir rename mkdir
84 rmdir creat link unlink symlink readlink chmod fchmod chown fchown lchown umask
96 gettimeofday getrlimit getrusage sysinfo times ptrace getuid syslog getgid
105 setuid setgid geteuid getegid setpgid getppid getpgrp setsid setreuid setregid
115 getgroups setgroups setresuid getresuid setresgid getresgid getpgid setfsuid
123 setfsgid getsid capget capset rt_sigpending rt_sigtimedwait rt_sigqueueinfo
130 rt_sigsuspend sigaltstack utime mknod uselib personality ustat statfs fstatfs
139 sysfs getpriority setpriority sched_setparam sched_getparam sched_setscheduler
145 sched_getscheduler sched_get_priority_max sched_get_priority_min
148 sched_rr_get_interval mlock munlock mlockall munlockall vhangup modify_ldt
155 pivot_root _sysctl prctl arch_prctl adjtimex setrlimit chroot sync acct
164 settimeofday mount umount2 swapon swapoff reboot sethostname setdomainname
172 iopl ioperm create_module init_module delete_module get_kernel_syms
178 query_module quotactl nfsservctl getpmsg putpmsg afs_syscall tuxcall security
186 gettid readahead setxattr lsetxattr fsetxattr getxattr lgetxattr fgetxattr
194 listxattr llistxattr flistxattr removexattr lremovexattr fremovexattr tkill
201 time futex sched_setaffinity sched_getaffinity set_thread_area io_setup
207 io_destroy io_getevents io_submit io_cancel get_thread_area lookup_dcookie
213 epoll_create epoll_ctl_old epoll_wait_old remap_file_pages getdents64
218 set_tid_address restart_syscall semtimedop fadvise64 timer_create
223 timer_settime timer_gettime timer_getoverrun timer_delete clock_settime
228 clock_gettime clock_getres clock_nanosleep exit_group epoll_wait epoll_ctl
234 tgkill utimes vserver mbind set_mempolicy get_mempolicy mq_open mq_unlink
242 mq_timedsend mq_timedreceive mq_notify mq_getsetattr kexec_load waitid add_key
249 request_key keyctl ioprio_set ioprio_get inotify_init inotify_add_watch
255 inotify_rm_watch migrate_pages openat mkdirat mknodat fchownat futimesat
262 newfstatat unlinkat renameat linkat symlinkat readlinkat fchmodat faccessat
270 pselect6 ppoll unshare set_robust_list get_robust_list splice tee
277 sync_file_range vmsplice move_pages utimensat epoll_pwait signalfd
283 timerfd_create eventfd fallocate timerfd_settime timerfd_gettime accept4
289 signalfd4 eventfd2 epoll_create1 dup3 pipe2 inotify_init1 preadv pwritev
297 rt_tgsigqueueinfo perf_event_open recvmmsg fanotify_init fanotify_mark
302 prlimit64 name_to_handle_at open_by_handle_at clock_adjtime syncfs sendmmsg
308 setns getcpu process_vm_readv process_vm_writev kcmp finit_module
314 sched_setattr sched_getattr renameat2 seccomp getrandom memfd_create
320 kexec_file_load bpf execveat userfaultfd membarrier mlock2 copy_file_range
327 preadv2 pwritev2 pkey_mprotect pkey_alloc pkey_free statx io_pgetevents rseq
424 pidfd_send_signal io_uring_setup io_uring_enter io_uring_register open_tree
429 move_mount fsopen fsconfig fsmount fspick pidfd_open clone3 close_range
437 openat2 pidfd_getfd faccessat2 process_madvise epoll_pwait2 mount_setattr
443 quotactl_fd landlock_create_ruleset landlock_add_rule landlock_restrict_self
447 memfd_secret process_mrelease futex_waitv set_mempolicy_home_node
"""


def _numbered(table: str) -> dict[int, str]:
    """``{number: name}`` of a table whose lines read ``first name name ...``, each name
    numbered one above the name before it."""
    numbers: dict[int, str] = {}
    for line in table.strip().splitlines():
        first, *names = line.split()
        numbers.update(enumerate(names, int(first)))
    return numbers


X86_64: dict[int, str] = _numbered(_TABLE)

# Calls whose whole point is to wait a requested time: left out of latency headlines.
SLEEPS = frozenset({"nanosleep", "clock_nanosleep", "pause", "alarm"})


NR: dict[str, int] = {name: nr for nr, name in X86_64.items()}
"""The number of each named syscall, the other way round."""


def syscall_name(nr: int) -> str:
    """``futex`` for 202; ``syscall_999`` for a number the table does not know."""
    return X86_64.get(nr, f"syscall_{nr}")
